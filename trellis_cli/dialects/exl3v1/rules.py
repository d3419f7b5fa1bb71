"""Validation of an exl3-v1 checkpoint: every check of b12x 1.5.1's manifest parser and layer reader, and
what that reader leaves unchecked (docs/findings.md, `exl3v1.*`).

Default run: the manifest (parsed while opening), each layer file's header (byte layout, metadata identity,
exact tensor set, dtypes, shapes, row stride), plus three small bounded reads per layer from local files:
the rate tables ([num_slots/8, E] bytes), each row's padding tail, and sign_pattern. `deep` adds the
finiteness of the rotations (the hidden-side tables are the shared data rules' vectors: validate/rules_data).
The manifest's sha256 of each layer file is compared by validate's one checksum rule (validate/checksums.py,
from `Dialect.recorded_hashes`), by default for local files.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.errors import CheckFailed
from trellis_cli.dialects.exl3v1.container import (CODES, HIDDEN_TABLES, RATES_FC1, RATES_FC2, ROTATIONS, SIGN_PATTERN,
                                          Exl3Layer, container, expected_metadata, finding_where, layer_rates,
                                          local_file, rate_table_shape)
from trellis_cli.dialects.exl3v1.layout import LayerRates, row_payloads
from trellis_cli.dialects.exl3v1.schema import KIND_OF_CODE, SLOT_CHANNELS, Manifest
from trellis_cli.findings import Finding, Location, Report, error, error_summary, warning
from trellis_cli.header_records import DTYPE_BYTES
from trellis_cli.formats.safetensors_layout import check_shard
from trellis_cli.dialects.exl3v1.pack import NOTE_KEY, note_problems, shown_value

MAX_ROWS_SHOWN = 5  # row findings per layer and code, then one summary line
TAIL_CHUNK_BYTES = 16 << 20  # padding tails are read at most this much at a time
MCG_MIN_BITS = 3  # b12x's trellis adapter (fused_moe/source.py TrellisSource) refuses mcg below K3


def required_tensors(m: Manifest) -> dict[str, str]:
    """Tensor name -> dtype, exactly the set the reader requires for this manifest."""
    out = {CODES: "U8", ROTATIONS: "F16", **dict.fromkeys(HIDDEN_TABLES, "F16")}
    if m.pair_structure:
        out |= {RATES_FC1: "U8", RATES_FC2: "U8"}
    if m.intermediate_hadamard:
        out[SIGN_PATTERN] = "U8"
    return out


def expected_shapes(m: Manifest) -> dict[str, tuple[int, ...]]:
    hidden_shape = (m.num_experts, m.hidden) if m.per_expert_input_rotations else (m.hidden,)
    return {ROTATIONS: (m.num_slots, m.num_experts, 3, SLOT_CHANNELS), **dict.fromkeys(HIDDEN_TABLES, hidden_shape),
            RATES_FC1: rate_table_shape(m), RATES_FC2: rate_table_shape(m), SIGN_PATTERN: (m.num_experts,)}


def check_exl3v1(ckpt: Checkpoint, report: Report, layers: list[int], *, deep: bool,
                 progress: Callable[[str, int, int], None] | None = None) -> None:
    """b12x's reader checks of the chosen layers; their recorded sha256 are compared by validate's one
    checksum rule (Dialect.recorded_hashes)."""
    box = container(ckpt)
    report.extend(ckpt.parse_findings)
    report.extend(note_findings(ckpt))
    report.count("manifest", 1)
    if box.manifest is None:
        return
    report.extend(check_mcg_bits(box.manifest, box.manifest_file))
    for done, index in enumerate(layers, 1):
        layer = box.layers[index]
        if layer.readable:
            report.extend(check_shard(layer.file, ckpt.headers[layer.file]))
            report.extend(check_layer(ckpt, box.manifest, layer))
            if deep:  # the hidden-side tables' values are the shared data rules' (Dialect.vectors)
                report.extend(check_finite(ckpt, box.manifest, layer))
        if progress is not None:
            progress("headers", done, len(layers))
    report.count("layers", len(layers))
    report.count("files", sum(box.layers[i].readable for i in layers))


def check_mcg_bits(m: Manifest, manifest_file: str) -> Iterator[Finding]:
    """Uniform mcg below K3: b12x's trellis adapter (the path that runs uniform exl3-v1) refuses it
    (TrellisSource: "MCG trellis execution requires at least K3"), though its reader and parser accept K2.
    Pair structures do not reach that adapter, so their 2-bit records are left to the reader's rules."""
    if m.codebook == "mcg" and m.bits is not None and m.bits < MCG_MIN_BITS:
        yield error("exl3v1.mcg-k2", Location(file=manifest_file, tensor="rates.bits"), "mcg at K2: b12x's trellis "
                    "adapter runs mcg at K3 and above only", f">= {MCG_MIN_BITS}", m.bits)


def note_findings(ckpt: Checkpoint) -> Iterator[Finding]:
    """A warning (b12x never reads config.json): a conversion to TR3 or a route pack refuses the same note."""
    for key, expected, found in note_problems(ckpt):
        yield warning("exl3v1.note", Location(file="config.json"), f"{NOTE_KEY}{key}: the note a TR3 -> exl3-v1 "
                      "conversion records is unusable; `repack --to tr3` and `--to route-pack` refuse it",
                      expected=expected, found=shown_value(found))


def check_layer(ckpt: Checkpoint, m: Manifest, layer: Exl3Layer) -> Iterator[Finding]:
    yield from _metadata(m, layer)
    required = required_tensors(m)
    present = set(layer.tensors)
    for name in sorted(set(required) - present):
        yield error("exl3v1.tensor-set", finding_where(layer, name), "required tensor is missing")
    for name in sorted(present - set(required)):
        yield error("exl3v1.tensor-set", finding_where(layer, name), "tensor is not part of this layer's exl3-v1 "
                    "tensor set (the reader refuses extra tensors)", ", ".join(sorted(required)), name)
    usable = set()
    for name, dtype in required.items():
        ref = layer.ref(name)
        if ref is None:
            continue
        if ref.dtype != dtype:
            yield error("exl3v1.dtype", finding_where(layer, name), "wrong dtype", dtype, ref.dtype)
            continue
        want = expected_shapes(m).get(name)
        if want is not None and tuple(ref.shape) != want:
            yield error("exl3v1.shape", finding_where(layer, name), "wrong shape", list(want), list(ref.shape))
            continue
        if ref.nbytes == math.prod(ref.shape) * DTYPE_BYTES[ref.dtype]:
            usable.add(name)
    stride = yield from _codes_shape(m, layer)
    if not local_file(ckpt, layer.ref(CODES) or next(iter(layer.tensors.values()), None)):
        yield warning("exl3v1.data-not-read", finding_where(layer), "the layer file is not on this machine: rate "
                      "tables, row padding and sign_pattern were not checked")
        return
    rates = None
    if m.pair_structure and {RATES_FC1, RATES_FC2} <= usable:
        rates = layer_rates(ckpt, layer.index)
        yield from _rate_codes(m, layer, rates)
    elif not m.pair_structure:
        rates = layer_rates(ckpt, layer.index)
    if stride is not None and CODES in usable and rates is not None and _rates_known(rates):
        yield from _rows(ckpt, m, layer, rates, stride)
    if SIGN_PATTERN in usable:
        yield from _sign_pattern(ckpt, layer)


def _metadata(m: Manifest, layer: Exl3Layer) -> Iterator[Finding]:
    found = layer.metadata or {}
    for key, want in expected_metadata(m, layer.index).items():
        if found.get(key) != want:
            yield error("exl3v1.metadata", finding_where(layer, f"__metadata__.{key}"), "layer file identity key "
                        "differs from the manifest", repr(want), repr(found.get(key)) if key in found else "absent")


def _codes_shape(m: Manifest, layer: Exl3Layer):
    """Generator returning the row stride when `codes` is [num_slots, stride] with an aligned stride."""
    ref = layer.ref(CODES)
    if ref is None or ref.dtype != "U8":
        return None
    if len(ref.shape) != 2 or ref.shape[0] != m.num_slots:
        yield error("exl3v1.shape", finding_where(layer, CODES), "codes is [num_slots, row_stride]",
                    f"[{m.num_slots}, stride]", list(ref.shape))
        return None
    stride = ref.shape[1]
    if stride % m.row_alignment:
        yield error("exl3v1.row-alignment", finding_where(layer, CODES), "row stride is not a multiple of "
                    "layout.row_alignment", f"multiple of {m.row_alignment}", stride)
        return None
    return stride


def _rates_known(rates: LayerRates) -> bool:
    return rates.uniform is not None or all(c in KIND_OF_CODE for t in (rates.fc1, rates.fc2) for r in t for c in r)


def _rate_codes(m: Manifest, layer: Exl3Layer, rates: LayerRates | None) -> Iterator[Finding]:
    if rates is None:
        yield error("file.unreadable", finding_where(layer, RATES_FC1), "the rate tables cannot be read")
        return
    for name, table in ((RATES_FC1, rates.fc1), (RATES_FC2, rates.fc2)):
        unknown = [(p, e, c) for p, row in enumerate(table) for e, c in enumerate(row) if c not in KIND_OF_CODE]
        if unknown:
            p, e, c = unknown[0]
            yield error("exl3v1.rate-code", finding_where(layer, name), f"{len(unknown)} byte(s) are no rate code; "
                        f"first at pair {p}, expert {e}", ", ".join(f"0x{v:02x}" for v in KIND_OF_CODE), f"0x{c:02x}")
    undeclared = sorted(k for k in rates.used_kinds() if k not in m.pair_kinds and not k.startswith("0x"))
    if undeclared:
        yield error("exl3v1.rate-undeclared", finding_where(layer, RATES_FC1), "the rate tables use pair kinds the "
                    "manifest does not declare", list(m.pair_kinds), undeclared)


def _rows(ckpt: Checkpoint, m: Manifest, layer: Exl3Layer, rates: LayerRates, stride: int) -> Iterator[Finding]:
    """Each row's bundles fit the stride and the bytes after them are zero (read: the padding tails only)."""
    ref = layer.ref(CODES)
    short, dirty = [], []
    for slot, payload in enumerate(row_payloads(m, rates)):
        if payload > stride:
            short.append((slot, payload))
            continue
        if payload == stride:
            continue
        try:
            first = _first_nonzero(ckpt, ref, slot * stride + payload, stride - payload)
        except CheckFailed as e:
            yield error("file.unreadable", finding_where(layer, CODES), str(e))
            return
        if first is not None:
            dirty.append((slot, payload + first))
    for slot, payload in short[:MAX_ROWS_SHOWN]:
        yield error("exl3v1.row-short", finding_where(layer, f"{CODES}[{slot}]"), "the row is shorter than its "
                    "experts' bundles", f">= {payload} bytes", f"{stride} bytes")
    for slot, column in dirty[:MAX_ROWS_SHOWN]:
        yield error("exl3v1.padding", finding_where(layer, f"{CODES}[{slot}]"), "non-zero byte in the row's "
                    "padding after the bundles", "zero padding", f"non-zero at byte {column}")
    for code, rows in (("exl3v1.row-short", short), ("exl3v1.padding", dirty)):
        if len(rows) > MAX_ROWS_SHOWN:
            yield error_summary(code, finding_where(layer, CODES), len(rows) - MAX_ROWS_SHOWN,
                                f"row(s) of layer {layer.index}")


def _first_nonzero(ckpt: Checkpoint, ref, offset: int, length: int) -> int | None:
    """Index of the first non-zero byte in [offset, offset+length) of the tensor's data, read in bounded
    chunks (a stride far above its bundles must not become one allocation)."""
    from trellis_cli.checkpoint.tensors import read_bytes

    for start in range(0, length, TAIL_CHUNK_BYTES):
        tail = read_bytes(ckpt, ref, offset + start, min(TAIL_CHUNK_BYTES, length - start))
        if tail.count(0) != len(tail):
            return start + next(i for i, b in enumerate(tail) if b)
    return None


def _sign_pattern(ckpt: Checkpoint, layer: Exl3Layer) -> Iterator[Finding]:
    from trellis_cli.checkpoint.tensors import read_tensor

    ref = layer.ref(SIGN_PATTERN)
    assert ref is not None  # checked usable by the caller
    values = read_tensor(ckpt, ref).tolist()
    bad = [(e, v) for e, v in enumerate(values) if v > 7]
    if bad:
        yield error("exl3v1.sign-pattern", finding_where(layer, SIGN_PATTERN), f"{len(bad)} value(s) above 7; "
                    f"first at expert {bad[0][0]}", "0..7", bad[0][1])


def check_finite(ckpt: Checkpoint, m: Manifest, layer: Exl3Layer) -> Iterator[Finding]:
    """--deep: the rotations hold no NaN or Inf (read in bounded row chunks)."""
    import torch

    from trellis_cli.checkpoint.tensors import read_rows

    for name in (ROTATIONS,):
        ref = layer.ref(name)
        if ref is None or ref.dtype != "F16" or tuple(ref.shape) != expected_shapes(m)[name]:
            continue
        rows = ref.shape[0]
        step = max(1, (16 << 20) // max(1, ref.nbytes // rows))
        for start in range(0, rows, step):
            try:
                chunk = read_rows(ckpt, ref, start, min(rows, start + step))
            except CheckFailed as e:
                yield error("file.unreadable", finding_where(layer, name), str(e))
                break
            bad = (~torch.isfinite(chunk.float())).nonzero()
            if len(bad):
                index = [int(v) + (start if i == 0 else 0) for i, v in enumerate(bad[0])]
                yield error("exl3v1.nonfinite", finding_where(layer, name), f"{len(bad)} NaN/Inf value(s) in this "
                            f"chunk; first at index {index}", "finite fp16", "NaN/Inf")
                break
