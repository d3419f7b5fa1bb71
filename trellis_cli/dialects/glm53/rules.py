"""The format rules of the GLM-5.3 unsliced stream: its declarations, then every routed tensor's name, dtype,
shape and K, and the codebook markers' values.

Format, not loader: `bits` may be any K (releases exist at K2, K4, K6 and K8); what the fork's R7-era loader
accepts beyond the format (K4 only, the exact architecture, TP 2) is its profile's verdict (validate/engine_r7.py).
Codes are `glm53.*`; docs/findings.md lists them.
"""

from __future__ import annotations

import os
from typing import Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.glm53.contract import (DTYPES, FIELDS, MARKER_FIELD, PROJECTIONS, TENSOR_SCHEMA,
                                                linear_shapes, moe_layers, quant_block, text_config)
from trellis_cli.dialects.glm53.container import is_rank_name
from trellis_cli.codebooks import MCG_MARKER
from trellis_cli.findings import Finding, Location, Severity, error, missing_ids, warning

MARKER_BYTES = 4
SPAN_GAP = 64 * 1024  # markers closer than this are read in one piece
_GEOMETRY = ("hidden_size", "moe_intermediate_size", "n_routed_experts")


def declared_bits(ckpt: Checkpoint) -> int | None:
    """The release's uniform K: `bits` of the quantization block when a whole number in 1..8."""
    block, _ = quant_block(ckpt.config, ckpt.quant_config)
    bits = (block or {}).get("bits")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits != int(bits) or not 1 <= bits <= 8:
        return None
    return int(bits)


def check_config(ckpt: Checkpoint) -> Iterator[Finding]:
    block, where_file = quant_block(ckpt.config, ckpt.quant_config)
    at = Location(file=where_file, tensor="quantization_config")
    assert block is not None  # detection found the scope
    if declared_bits(ckpt) is None:
        yield error("glm53.bits", Location(file=where_file, tensor="quantization_config.bits"),
                    "bits must be the release's one K, a whole number in 1..8", expected="2..8", found=block.get("bits"))
    if block.get("codebook") != "mcg":
        yield error("glm53.codebook", Location(file=where_file, tensor="quantization_config.codebook"),
                    f"the tensor schema {TENSOR_SCHEMA} stores an mcg marker per linear", expected="mcg",
                    found=block.get("codebook"))
    if block.get("quant_method") != "exl3":
        yield error("glm53.quant-method", Location(file=where_file, tensor="quantization_config.quant_method"),
                    "the scope belongs to the exl3 quantization method", expected="exl3",
                    found=block.get("quant_method"))
    other = ckpt.quant_config if where_file == "config.json" else ckpt.config.get("quantization_config")
    if isinstance(other, dict) and other != block:
        differ = sorted(k for k in set(other) | set(block) if other.get(k) != block.get(k))
        yield warning("glm53.quant-config-differs", at, "config.json's quantization_config and "
                      "quantization_config.json disagree (the loader reads config.json's)", found=differ[:8])
    text = text_config(ckpt.config)
    for key in _GEOMETRY:
        value = text.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            yield error("glm53.geometry", Location(file="config.json", tensor=f"text_config.{key}"),
                        "the routed experts' shapes follow from this field", expected="a positive integer",
                        found=value)
    if moe_layers(text) is None:
        yield error("glm53.geometry", Location(file="config.json", tensor="text_config.first_k_dense_replace"),
                    "first_k_dense_replace, num_hidden_layers and num_nextn_predict_layers must be non-negative "
                    "integers: they place the MoE layers", found={k: text.get(k) for k in (
                        "first_k_dense_replace", "num_hidden_layers", "num_nextn_predict_layers")})
    h, i = text.get("hidden_size"), text.get("moe_intermediate_size")
    for key, value in (("hidden_size", h), ("moe_intermediate_size", i)):
        if isinstance(value, int) and value % 128:
            yield error("glm53.geometry", Location(file="config.json", tensor=f"text_config.{key}"),
                        "EXL3 rotations work in 128-channel Hadamard blocks", expected="a multiple of 128",
                        found=value)


def check_tensors(ckpt: Checkpoint, layers: list[int]) -> Iterator[Finding]:
    """Every chosen layer: every expert, projection and field present, each with the schema's dtype and shape
    at the declared K; no rank segment, no field the schema does not name."""
    text = text_config(ckpt.config)
    h, i, e = ckpt.hidden, ckpt.intermediate, ckpt.num_experts
    k = declared_bits(ckpt)
    for name, ref in ckpt.tensors.items():
        if is_rank_name(name):
            yield error("glm53.rank-name", Location(file=ref.file, tensor=name), "an unsliced stream stores "
                        "full-width experts with no rank segment: the loader builds no such name",
                        expected=TENSOR_SCHEMA)
    expected_layers = moe_layers(text) or []
    for li in sorted(set(ckpt.layers) - set(expected_layers)):
        if ckpt.layers[li].experts:
            yield error("glm53.layer-extra", Location(layer=li), "routed experts outside the MoE layers "
                        "(first_k_dense_replace .. num_hidden_layers + num_nextn_predict_layers - 1)",
                        expected=_span(expected_layers), found=li)
    for li in layers:
        moe = ckpt.layers.get(li)
        where = Location(layer=li)
        if moe is None or not moe.experts:
            yield error("glm53.layer-missing", where, "a MoE layer holds no routed experts",
                        expected=TENSOR_SCHEMA.replace("{L}", str(li)))
            continue
        for ref in moe.unparsed:
            if not is_rank_name(ref.name):
                yield error("glm53.name", Location(file=ref.file, layer=li, tensor=ref.name), "a name under "
                            "mlp.experts that the schema does not spell (canonical ids, gate/up/down_proj, one field)",
                            expected=TENSOR_SCHEMA)
        if e is not None:
            shown, missing = missing_ids(range(e), moe.experts)
            if missing:
                yield error("glm53.expert-missing", where, f"{missing} expert(s) absent: the loader "
                            "needs every (expert, projection)", expected=f"experts 0..{e - 1}", found=shown)
            extra = sorted(x for x in moe.experts if x >= e)
            if extra:
                yield error("glm53.expert-extra", where, "expert ids beyond n_routed_experts",
                            expected=f"< {e}", found=extra[:8])
        yield from _linears(moe, li, h, i, k)


def _linears(moe, li: int, h: int | None, i: int | None, k: int | None) -> Iterator[Finding]:
    for expert in sorted(moe.experts):
        projs = moe.experts[expert]
        for proj in PROJECTIONS:
            lin = projs.get(proj, {}).get(0)
            where = Location(layer=li, expert=expert, projection=proj)
            if lin is None:
                yield error("glm53.tensor-missing", where, "projection absent", expected=list(FIELDS))
                continue
            if lin.mul1 is not None:
                yield error("glm53.codebook", Location(file=lin.mul1.file, layer=li, expert=expert, projection=proj,
                            tensor=lin.mul1.name), "a mul1 marker: the schema's codebook marker is mcg",
                            expected="mcg", found="mul1")
            for ref in lin.extra:
                yield error("glm53.field", Location(file=ref.file, layer=li, expert=expert, projection=proj,
                            tensor=ref.name), "a field the schema does not name", expected=list(FIELDS),
                            found=ref.name.rsplit(".", 1)[-1])
            shapes = linear_shapes(h, i, proj, k) if h and i and k else None
            for field in FIELDS:
                ref = getattr(lin, field)
                if ref is None:
                    yield error("glm53.tensor-missing", where, f".{field} absent", expected=list(FIELDS),
                                found=field)
                    continue
                at = Location(file=ref.file, layer=li, expert=expert, projection=proj, tensor=ref.name)
                if ref.dtype != DTYPES[field]:
                    yield error("glm53.dtype", at, f".{field} dtype", expected=DTYPES[field], found=ref.dtype)
                if shapes is not None and tuple(ref.shape) != shapes[field]:
                    code = "glm53.k" if field == "trellis" and tuple(ref.shape[:2]) == shapes[field][:2] else \
                        "glm53.shape"
                    found_k = ref.shape[-1] // 16 if field == "trellis" and ref.shape and ref.shape[-1] % 16 == 0 \
                        else None
                    message = (f"trellis at K{found_k}, not the declared bits" if code == "glm53.k"
                               else f".{field} shape")
                    yield error(code, at, message, expected=list(shapes[field]), found=list(ref.shape))


def check_markers(ckpt: Checkpoint, layers: list[int]) -> Iterator[Finding]:
    """The mcg markers' int32 values (0xCBAC1FED): read from local files, a few bytes each."""
    if ckpt.source.root is None:
        yield Finding("marker.not-read", Severity.INFO, Location(), "codebook marker values were not read (a remote "
                      "source is not downloaded): the loader refuses a wrong one at load")
        return
    by_file: dict[str, list] = {}
    for li in layers:
        for expert, projs in ckpt.layers.get(li, _EMPTY).experts.items():
            for proj, by_rank in projs.items():
                ref = by_rank[0].mcg
                if ref is not None and (ref.dtype, tuple(ref.shape), ref.nbytes) == ("I32", (), MARKER_BYTES):
                    by_file.setdefault(ref.file, []).append((ref, li, expert, proj))
    for file, items in sorted(by_file.items()):
        try:
            values = _read_scalars(ckpt.source.local_path(file), [ref for ref, *_ in items])
        except OSError as err:
            yield error("data.unreadable", Location(file=file), f"cannot read the codebook markers ({err.strerror})")
            continue
        for ref, li, expert, proj in items:
            value = values.get(ref.name)
            if value is None:
                yield error("data.unreadable", Location(file=file, tensor=ref.name), "marker past the end of file")
            elif value != MCG_MARKER:
                yield error("glm53.marker", Location(file=file, layer=li, expert=expert, projection=proj,
                            tensor=ref.name), f".{MARKER_FIELD} marker holds the wrong value (the loader refuses it)",
                            expected=hex(MCG_MARKER & 0xFFFFFFFF), found=hex(value & 0xFFFFFFFF))


class _Empty:
    experts: dict = {}


_EMPTY = _Empty()


def _read_scalars(path, refs) -> dict[str, int]:
    size = os.path.getsize(path)
    starts = sorted((ref.data_start + ref.begin, ref.name) for ref in refs)
    values: dict[str, int] = {}
    with open(path, "rb") as f:
        span: list[tuple[int, str]] = []
        for item in starts + [(None, None)]:
            if span and (item[0] is None or item[0] - span[-1][0] > SPAN_GAP):
                begin = span[0][0]
                f.seek(begin)
                data = f.read(span[-1][0] + MARKER_BYTES - begin)
                for at, name in span:
                    chunk = data[at - begin:at - begin + MARKER_BYTES]
                    if len(chunk) == MARKER_BYTES and at + MARKER_BYTES <= size:
                        values[name] = int.from_bytes(chunk, "little", signed=True)
                span = []
            if item[0] is not None:
                span.append(item)
    return values


def _span(layers: list[int]) -> str:
    return f"{layers[0]}..{layers[-1]}" if layers else "none"
