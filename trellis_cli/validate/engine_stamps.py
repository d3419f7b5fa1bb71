"""Loader checks on how a checkpoint says what it is: the quantization config vLLM selects a method from, the
`quant_method` stamp and JSON integers against int() coercion (protected tensors: engine_protected.py).

These differ between the fork's loader versions (docs/engines.md cites each): vLLM picks the quantization
method from config.json's embedded `quantization_config` only; the fork's EXL3 override then recognizes its
own metadata (hybrid_tr3_tail; in the R7 version also r7_routed_experts and the GLM-5.3 scope), and anything
else is served by whatever the stamp names. The #190-era versions read counts with int(); the shared-H version
wants JSON integers.
"""

from __future__ import annotations

from typing import Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import Location
from trellis_cli.header import is_int
from trellis_cli.validate.engine_rules import Refusal, rank_sliced_contract

STAMP = Location(file="config.json", tensor="quantization_config.quant_method")


def embedded(ckpt: Checkpoint) -> dict | None:
    q = ckpt.config.get("quantization_config")
    return q if isinstance(q, dict) else None


def text_config(ckpt: Checkpoint) -> dict:
    """The text model's config: `text_config` where config.json nests one (multimodal), else config.json."""
    nested = ckpt.config.get("text_config")
    return nested if isinstance(nested, dict) else ckpt.config


def embedded_quant_config(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """vLLM reads the quantization method from config.json's quantization_config; without one no quantized
    loader is ever called (quantization_config.json alone is not consulted), and the EXL3 tensors meet an
    unquantized model."""
    if embedded(ckpt) is None:
        external = " (quantization_config.json exists but is not where the method is chosen)" \
            if ckpt.quant_config is not None else ""
        yield Refusal("engine.quant-config", "no quantization_config in config.json",
                      Location(file="config.json", tensor="quantization_config"),
                      "config.json embeds no quantization_config, so vLLM selects no quantization method and never "
                      "calls the EXL3 loader" + external, expected="an embedded quantization_config", found=None)


def stamp_selects_exl3(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """#190 and shared-H: the EXL3 override recognizes only hybrid_tr3_tail; a plain EXL3 checkpoint is served
    by the method its stamp names, so a `modelopt` (or any other) stamp hands it to another quantizer."""
    q = embedded(ckpt)
    if not dialect_of(ckpt).module_records or q is None or q.get("quant_method") == "exl3":
        return
    yield Refusal("engine.quant-method", f"stamped {q.get('quant_method')!r}", STAMP,
                  "without hybrid_tr3_tail the EXL3 override does not claim the checkpoint, so config.json's "
                  "quant_method chooses the loader, and it is not exl3", expected="exl3", found=q.get("quant_method"))


def json_ints(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H version: tp and experts_per_layer positive JSON integers, moe_layers two JSON integers, a uniform
    `bits` a number (a string other than 'mixed' takes the uniform path and finds no per-layer map)."""
    h = rank_sliced_contract(ckpt)
    if h is None:
        return
    for key in ("tp", "experts_per_layer"):
        if key in h and not is_int(h[key]):
            yield _not_json_int(key, h[key], "must be a positive JSON integer")
    layers_value = h.get("moe_layers")
    if isinstance(layers_value, list) and not all(is_int(v) for v in layers_value):
        yield _not_json_int("moe_layers", layers_value, "must be two JSON integers")
    bits = h.get("bits")
    if isinstance(bits, str) and bits.strip().lower() != "mixed" and "trellis_bits_by_layer" not in h:
        yield _not_json_int("bits", bits, "a string other than 'mixed' is not a uniform K to this version: the "
                            "uniform path then has no per-layer map")


def _not_json_int(key: str, value: object, why: str) -> Refusal:
    return Refusal("engine.json-int", f"{key} not a JSON integer", Location(file="config.json",
                   tensor=f"hybrid_tr3_tail.{key}"), f"this version does not coerce: {key} {why}",
                   expected="a JSON integer", found=value)


def bits_map(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H version: trellis_bits_by_layer is forbidden with bits 'mixed'; otherwise an object keyed by every
    layer of moe_layers (decimal strings) with JSON-integer K in 3, 4, 5, 6, 8 (#190 does not read it)."""
    h = rank_sliced_contract(ckpt)
    if h is None or "trellis_bits_by_layer" not in h:
        return
    where = Location(file="config.json", tensor="hybrid_tr3_tail.trellis_bits_by_layer")
    if h.get("bits") == "mixed":
        yield Refusal("engine.bits-map", "trellis_bits_by_layer with bits 'mixed'", where, "a mixed checkpoint may "
                      "not declare trellis_bits_by_layer in this version", expected="no trellis_bits_by_layer",
                      found="trellis_bits_by_layer")
        return
    for problem, expected, found in dialect_of(ckpt).bit_map_problems(ckpt):
        yield Refusal("engine.bits-map", "trellis_bits_by_layer malformed", where, f"trellis_bits_by_layer: "
                      f"{problem}", expected=expected, found=found)


def bits_required(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """#190 and R7 versions: `bits` is a required hybrid_tr3_tail key (trellis_bits_by_layer does not replace
    it: they never read the map)."""
    h = rank_sliced_contract(ckpt)
    if h is not None and "bits" not in h:
        yield Refusal("engine.bits-required", "bits missing", Location(file="config.json",
                      tensor="hybrid_tr3_tail.bits"), "this version requires bits among the rank-sliced keys and "
                      "does not read trellis_bits_by_layer", expected="bits", found=None)
