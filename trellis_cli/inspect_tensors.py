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
from typing import Any, Iterator, Mapping, Sequence, TypedDict, overload

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import shard_header
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.errors import CheckFailed
from trellis_cli.sources import SourceDescription

_LAYER_IN_NAME = re.compile(r"model\.layers\.(0|[1-9][0-9]*)\.")
TRELLIS_SUFFIX = ".trellis"


class TensorRow(TypedDict):
    """One tensor of the listing, in its JSON key order."""

    file: str
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    layer: int | None  # the MoE layer its name or its file says; None for a tensor of no layer
    k: int | None  # bits per weight of EXL3 codes
    bpw: float | None


class TensorTotals(TypedDict):
    tensors: int
    bytes: int
    files: int
    by_dtype: dict[str, dict[str, int]]  # dtype -> {"tensors", "bytes"}


class TensorListing(TypedDict):
    """`inspect --tensors`: its rows streamed from the headers, per-layer and whole totals, in JSON key order."""

    dialect: str
    source: SourceDescription  # Source.describe()
    tensors: TensorRows
    layers: list[dict[str, Any]]  # per MoE layer: tensors, bytes, code bytes and bits per weight
    totals: TensorTotals
    unreadable: list[dict[str, str]]  # files whose header could not be read: {"file", "error"}


def build_tensor_listing(ckpt: Checkpoint, layers: list[int] | None = None) -> TensorListing:
    """Every tensor (of the chosen MoE layers only, when `layers` is given), per-layer and whole totals. The
    rows (`tensors`) are a `TensorRows`: made from the headers each time they are read, never all held at once
    (a production checkpoint has ~935k; as dicts they took 2 GB)."""
    chosen = set(layers) if layers is not None else None
    rows = TensorRows(ckpt, chosen)
    layer_totals: dict[int, dict[str, Any]] = {}
    by_dtype: dict[str, dict[str, int]] = {}
    count, total, files = 0, 0, set()
    for row in rows:  # one pass for the totals; the rows themselves are dropped as they go
        count += 1
        total += row["bytes"]
        files.add(row["file"])
        d = by_dtype.setdefault(row["dtype"], {"tensors": 0, "bytes": 0})
        d["tensors"] += 1
        d["bytes"] += row["bytes"]
        _add_to_layer(layer_totals, row)
    rows.length = count
    if layers is not None:  # as for `inspect --layers`: every chosen layer must be there
        from trellis_cli.selection import require_present

        require_present(layers, sorted(rows.seen))
    totals: TensorTotals = {"tensors": count, "bytes": total, "files": len(files),
                            "by_dtype": dict(sorted(by_dtype.items()))}
    return {"dialect": ckpt.dialect, "source": ckpt.source.describe(), "tensors": rows,
            "layers": _finish_layers(layer_totals), "totals": totals, "unreadable": rows.unreadable}


class TensorRows(Sequence[TensorRow]):
    """The listing's rows in file order, made from the checkpoint's headers each time they are iterated (one
    row dict alive at a time when streamed). A Sequence: len, index and iteration as a list's."""

    def __init__(self, ckpt: Checkpoint, chosen: set[int] | None) -> None:
        self.ckpt, self.chosen = ckpt, chosen
        dialect = dialect_of(ckpt)
        self.file_layers = dialect.layer_files(ckpt)  # files holding one MoE layer under names without a layer
        self.codes_tables = dialect.codes_tables(ckpt)  # file -> (offset, weights) of a table mixing K per expert
        self.seen: set[int] = set()
        self.unreadable: list[dict[str, str]] = []
        self.length: int | None = None
        self._files = sorted(name for name, size in ckpt.files.items()
                             if name.endswith(".safetensors") and size >= 0)

    def __iter__(self) -> Iterator[TensorRow]:
        first = self.length is None  # the first pass records the layers seen and the unreadable files
        for file in self._files:
            try:
                header = shard_header(self.ckpt, file)
            except CheckFailed as e:
                if first:
                    self.unreadable.append({"file": file, "error": str(e)})
                continue
            table = self.codes_tables.get(file)
            for entry in sorted(header.tensors.values(), key=lambda e: e.begin):  # file order, as stored
                layer = self.file_layers.get(file, _layer_of(entry.name))
                if layer is not None and first:
                    self.seen.add(layer)
                if self.chosen is not None and layer not in self.chosen:
                    continue
                nbytes = entry.end - entry.begin
                is_codes = table is not None and table[0] == entry.begin  # the container's codes table
                k, bpw = _k_and_bpw(entry.name, entry.dtype, tuple(entry.shape), nbytes,
                                    table[1] if table else None, is_codes)
                yield {"file": file, "name": entry.name, "dtype": entry.dtype, "shape": list(entry.shape),
                       "bytes": nbytes, "layer": layer, "k": k, "bpw": bpw}

    def __len__(self) -> int:
        if self.length is None:
            self.length = sum(1 for _ in self)
        return self.length

    @overload
    def __getitem__(self, index: int) -> TensorRow: ...

    @overload
    def __getitem__(self, index: slice) -> list[TensorRow]: ...

    def __getitem__(self, index: int | slice) -> Any:
        return list(self)[index]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, TensorRows)) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by content, as a list is


def listing_json(listing: TensorListing) -> dict[str, Any]:
    """The listing as one plain JSON-ready document (its rows in a list): for a caller that keeps it whole."""
    return {**listing, "tensors": list(listing["tensors"])}


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


def _add_to_layer(by_layer: dict[int, dict[str, Any]], row: TensorRow) -> None:
    if row["layer"] is None:
        return
    t = by_layer.setdefault(row["layer"], {"layer": row["layer"], "tensors": 0, "bytes": 0, "code_bytes": 0,
                                           "code_bits_per_weight": None})
    t["tensors"] += 1
    t["bytes"] += row["bytes"]
    if row["bpw"] is not None:
        t["code_bytes"] += row["bytes"]
        t.setdefault("_weights", 0)
        t["_weights"] += row["bytes"] * 8 / row["bpw"]


def _finish_layers(by_layer: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    for t in by_layer.values():
        w = t.pop("_weights", 0)
        t["code_bits_per_weight"] = round(t["code_bytes"] * 8 / w, 4) if w else None
    return [by_layer[k] for k in sorted(by_layer)]


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
