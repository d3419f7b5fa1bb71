"""`trellis inspect --tensors`: every tensor of every safetensors file, the way gguf-dump lists a file.

Each row: file, name, dtype, shape, bytes, the MoE layer it belongs to (from its name, or from the file for
layer files that hold one layer: route-pack `layer-LLL-rank-R`, exl3-v1's per-layer files), and for EXL3 codes
K and bits per weight: a `.trellis` tensor (TR3, plain EXL3, R7, a route pack's `tier{t}.trellis`) stores
exactly K bits per weight, K = shape[-1] / 16; an exl3-v1 `codes` table mixes K per expert, so it has no single
K and its bpw is its bytes (padding included) over the layer's weights. Headers only: nothing is downloaded.
Plain data out (`build_tensor_listing` -> dict); the renderings are pure functions of it.
"""

from __future__ import annotations

import re
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import shard_header
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.errors import CheckFailed

_LAYER_IN_NAME = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.")
TRELLIS_SUFFIX = ".trellis"


def build_tensor_listing(ckpt: Checkpoint, layers: list[int] | None = None) -> dict[str, Any]:
    """Every tensor (of the chosen MoE layers only, when `layers` is given), per-layer and whole totals."""
    chosen = set(layers) if layers is not None else None
    dialect = dialect_of(ckpt)
    file_layers = dialect.layer_files(ckpt)  # files holding one MoE layer under names without a layer
    codes_tables = dialect.codes_tables(ckpt)  # file -> (offset, weights) of a table mixing K per expert
    rows: list[dict[str, Any]] = []
    seen: set[int] = set()
    unreadable: list[dict[str, str]] = []
    for file in sorted(name for name, size in ckpt.files.items() if name.endswith(".safetensors") and size >= 0):
        try:
            header = shard_header(ckpt, file)
        except CheckFailed as e:
            unreadable.append({"file": file, "error": str(e)})
            continue
        for entry in sorted(header.tensors.values(), key=lambda e: e.begin):  # file order, as stored
            layer = file_layers.get(file, _layer_of(entry.name))
            if layer is not None:
                seen.add(layer)
            if chosen is not None and layer not in chosen:
                continue
            nbytes = entry.end - entry.begin
            table = codes_tables.get(file)
            is_codes = table is not None and table[0] == entry.begin  # the container's codes table, any spelling
            k, bpw = _k_and_bpw(entry.name, entry.dtype, tuple(entry.shape), nbytes, table[1] if table else None,
                                is_codes)
            rows.append({"file": file, "name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape),
                         "bytes": nbytes, "layer": layer, "k": k, "bpw": bpw})
    if layers is not None:  # as for `inspect --layers`: every chosen layer must be there
        from trellis_cli.selection import require_present

        require_present(layers, sorted(seen))
    return {"dialect": ckpt.dialect, "source": ckpt.source.describe(), "tensors": rows,
            "layers": _layer_totals(rows), "totals": _totals(rows), "unreadable": unreadable}


MAX_LAYER_DIGITS = 12  # longer is a damaged header, and past 4300 digits int() refuses it


def _layer_of(name: str) -> int | None:
    m = _LAYER_IN_NAME.match(name)
    if m is None:
        return None
    if len(m.group(1)) > MAX_LAYER_DIGITS:
        raise CheckFailed(f"tensor {name[:40]!r}...: a layer number of {len(m.group(1)):,} digits; no model has "
                          "that many layers (a damaged header)")
    return int(m.group(1))


def _k_and_bpw(name: str, dtype: str, shape: tuple[int, ...], nbytes: int,
               layer_weights: int | None, is_codes: bool = False) -> tuple[int | None, float | None]:
    if name.endswith(TRELLIS_SUFFIX) and dtype == "I16" and len(shape) >= 3 and shape[-1] % 16 == 0 and shape[-1]:
        k = shape[-1] // 16
        return k, float(k)
    if is_codes and layer_weights:
        return None, round(nbytes * 8 / layer_weights, 4)
    return None, None


def _layer_totals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_layer: dict[int, dict[str, Any]] = {}
    for row in rows:
        if row["layer"] is None:
            continue
        t = by_layer.setdefault(row["layer"], {"layer": row["layer"], "tensors": 0, "bytes": 0, "code_bytes": 0,
                                               "code_bits_per_weight": None})
        t["tensors"] += 1
        t["bytes"] += row["bytes"]
        if row["bpw"] is not None:
            t["code_bytes"] += row["bytes"]
            t.setdefault("_weights", 0)
            t["_weights"] += row["bytes"] * 8 / row["bpw"]
    for t in by_layer.values():
        w = t.pop("_weights", 0)
        t["code_bits_per_weight"] = round(t["code_bytes"] * 8 / w, 4) if w else None
    return [by_layer[k] for k in sorted(by_layer)]


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_dtype: dict[str, dict[str, int]] = {}
    for row in rows:
        d = by_dtype.setdefault(row["dtype"], {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += row["bytes"]
    return {"tensors": len(rows), "bytes": sum(r["bytes"] for r in rows),
            "files": len({r["file"] for r in rows}), "by_dtype": dict(sorted(by_dtype.items()))}


# ---- renderings ---------------------------------------------------------------------------------------------

def _shape(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _k(row: dict[str, Any]) -> str:
    return "-" if row["k"] is None else f"K{row['k']}"


def _bpw(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def render_text(doc: dict[str, Any]) -> list[str]:
    """One line per tensor in file order, then per-layer and whole totals."""
    lines = [f"{'#':>7}  {'bytes':>12}  {'dtype':<6} {'K':<3} {'bpw':>6}  {'shape':<24} file: name"]
    for i, row in enumerate(doc["tensors"]):
        lines.append(f"{i:>7}  {row['bytes']:>12,}  {row['dtype']:<6} {_k(row):<3} {_bpw(row['bpw']):>6}  "
                     f"{_shape(row['shape']):<24} {row['file']}: {row['name']}")
    lines += _unreadable_lines(doc)
    lines.append("")
    for t in doc["layers"]:
        lines.append(f"layer {t['layer']}: {t['tensors']:,} tensors, {t['bytes']:,} bytes, codes "
                     f"{t['code_bytes']:,} bytes at {_bpw(t['code_bits_per_weight'])} bpw")
    totals = doc["totals"]
    dtypes = ", ".join(f"{d} {v['tensors']:,} ({v['bytes']:,} bytes)" for d, v in totals["by_dtype"].items())
    lines.append(f"total: {totals['tensors']:,} tensors, {totals['bytes']:,} bytes in {totals['files']} file(s)"
                 + (f"; {dtypes}" if dtypes else ""))
    return lines


def render_markdown(doc: dict[str, Any]) -> list[str]:
    """One table per MoE layer (and one for tensors outside any layer), then totals."""
    def row(*cells: Any) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    groups: dict[Any, list[dict[str, Any]]] = {}
    for r in doc["tensors"]:
        groups.setdefault(r["layer"], []).append(r)
    lines: list[str] = []
    layer_totals = {t["layer"]: t for t in doc["layers"]}
    for layer in sorted(groups, key=lambda x: (x is None, x or 0)):
        title = "Tensors outside the MoE layers" if layer is None else f"Layer {layer}"
        lines += [f"## {title}", "", row("name", "file", "dtype", "shape", "bytes", "K", "bpw"), row(*["---"] * 7)]
        lines += [row(r["name"], r["file"], r["dtype"], _shape(r["shape"]), f"{r['bytes']:,}", _k(r), _bpw(r["bpw"]))
                  for r in groups[layer]]
        if layer in layer_totals:
            t = layer_totals[layer]
            lines += ["", f"{t['tensors']:,} tensors, {t['bytes']:,} bytes; codes {t['code_bytes']:,} bytes at "
                          f"{_bpw(t['code_bits_per_weight'])} bpw"]
        lines.append("")
    totals = doc["totals"]
    lines += ["## Totals", "", row("dtype", "tensors", "bytes"), row("---", "---", "---")]
    lines += [row(d, f"{v['tensors']:,}", f"{v['bytes']:,}") for d, v in totals["by_dtype"].items()]
    lines.append(row("all", f"{totals['tensors']:,}", f"{totals['bytes']:,}"))
    lines += _unreadable_lines(doc)
    return lines


def _unreadable_lines(doc: dict[str, Any]) -> list[str]:
    return [f"unreadable: {u['file']}: {u['error']}" for u in doc["unreadable"]]
