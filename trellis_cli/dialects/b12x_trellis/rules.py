"""The `b12x_trellis` version-2 rules, as each b12x release's parser (`TrellisConfig`, fused_moe/config.py) and
runtime read them. Torch-free.

Two eras: b12x 1.3.0 names its lookup codebooks `sqg_e4m3` / `sqg_fp16` and its expert transform
`coupled_hadamard` with `draw_granularity`; b12x 1.5.x (1.5.0 = 1.5.1) renamed them `lut_e4m3` / `lut_fp16`
and `intermediate_hadamard` with `sign_pattern_granularity`. Everything else is the same, and each parser
refuses the other's names. `parse` returns every problem a release's parser would raise (it stops at the
first; all are listed here), each naming its rule and field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RELEASE_151, RELEASE_130 = "b12x 1.5.1", "b12x 1.3.0"


@dataclass(frozen=True)
class Era:
    release: str
    codebooks: tuple[str, ...]
    expert_kind: str  # the expert transform besides "none"
    granularity_key: str  # its sign-draw granularity field


ERAS = (Era(RELEASE_151, ("mcg", "lut_e4m3", "lut_fp16"), "intermediate_hadamard", "sign_pattern_granularity"),
        Era(RELEASE_130, ("mcg", "sqg_e4m3", "sqg_fp16"), "coupled_hadamard", "draw_granularity"))
RATE_GRANULARITIES = ("uniform", "per_layer", "per_expert", "per_expert_projection")
SCALE_GRANULARITIES = ("none", "uniform", "per_layer", "per_expert")
SCALE_FAMILIES = ("input_scales", "intermediate_scales", "output_scales")
SLOT_CHANNELS = 32
# Nibbles a codebook defines (the atom rate check; each era's names): mcg K2..K6, e4m3 K2..K4, fp16 K5/K6.
NIBBLES = {"mcg": range(2, 7), "lut_e4m3": range(2, 5), "sqg_e4m3": range(2, 5), "lut_fp16": range(5, 7),
           "sqg_fp16": range(5, 7)}
MIXED_TIERS = (3, 4, 5)  # the wheels' projection-tiered mcg path: symmetric K3/K4/K5 only


@dataclass(frozen=True)
class Problem:
    rule: str  # a short name of the check, the finding code's tail
    field: str  # dotted path under quantization_config
    message: str
    expected: Any = None
    found: Any = None


@dataclass
class Block:
    """What the parser keeps of a block that passed (values only where they parsed)."""

    codebook: str | None = None
    granularity: str | None = None
    group_size: int | None = None
    problems: list[Problem] = field(default_factory=list)


def _shown(value: Any) -> Any:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Parser:
    def __init__(self, era: Era) -> None:
        self.era = era
        self.block = Block()

    def bad(self, rule: str, where: str, message: str, expected: Any = None, found: Any = None) -> None:
        self.block.problems.append(Problem(rule, where, message, expected, found))

    def obj(self, value: Any, where: str, required: set[str], optional: frozenset[str] | set[str] = frozenset()
            ) -> dict[str, Any] | None:
        if not isinstance(value, dict):
            self.bad("type", where, "must be a JSON object", "object", type(value).__name__)
            return None
        for key in sorted(required - set(value)):
            self.bad("missing-field", f"{where}.{key}", "required field is missing")
        for key in sorted(set(value) - required - optional):
            self.bad("unknown-field", f"{where}.{key}", f"unknown field (the {self.era.release} parser refuses "
                     "unknown fields)")
        return value

    def enum(self, value: Any, where: str, choices: tuple[str, ...]) -> str | None:
        if not isinstance(value, str) or value not in choices:
            self.bad("enum", where, "not one of the values this parser takes" if isinstance(value, str)
                     else "must be a string", ", ".join(choices), _shown(value))
            return None
        return value

    def positive(self, value: Any, where: str) -> int | None:
        if not _int(value) or value <= 0:
            self.bad("positive-int", where, "must be a positive JSON integer (not a boolean)", "positive integer",
                     _shown(value))
            return None
        return value

    def power_of_two(self, value: Any, where: str) -> None:
        size = self.positive(value, where)
        if size is not None and size & (size - 1):
            self.bad("power-of-two", where, "block sizes are powers of two", "a power of two", size)


def parse(quant: Any, era: Era) -> Block:
    """`quantization_config` as `era`'s `TrellisConfig.from_quantization_config` reads it."""
    p = _Parser(era)
    wrapper = p.obj(quant, "quantization_config", {"quant_method", "b12x_trellis"})
    if wrapper is None:
        return p.block
    if "quant_method" in wrapper and wrapper["quant_method"] != "b12x_trellis":
        p.bad("quant-method", "quantization_config.quant_method", "must be b12x_trellis", "b12x_trellis",
              _shown(wrapper["quant_method"]))
    if "b12x_trellis" not in wrapper:
        return p.block
    where = "quantization_config.b12x_trellis"
    top = p.obj(wrapper["b12x_trellis"], where, {"version", "codebook", "rate", "scale", "transform"})
    if top is None:
        return p.block
    if "version" in top and (not _int(top["version"]) or top["version"] != 2):
        p.bad("version", f"{where}.version", "unsupported b12x_trellis version", 2, _shown(top["version"]))
    if "codebook" in top:
        p.block.codebook = p.enum(top["codebook"], f"{where}.codebook", era.codebooks)
    if "rate" in top:
        _rate(p, top["rate"], f"{where}.rate")
    if "scale" in top:
        _scale(p, top["scale"], f"{where}.scale")
    if "transform" in top:
        _transform(p, top["transform"], f"{where}.transform")
    return p.block


def _rate(p: _Parser, value: Any, where: str) -> None:
    rate = p.obj(value, where, {"granularity"}, {"group_size"})
    if rate is None:
        return
    if "group_size" in rate and rate["group_size"] is not None:  # the parser reads it with a default of None
        size = p.positive(rate["group_size"], f"{where}.group_size")
        if size is not None and size % SLOT_CHANNELS:
            p.bad("group-size", f"{where}.group_size", "a multiple of the 32-channel slot width",
                  "multiple of 32", size)
        elif size is not None:
            p.block.group_size = size
    if "granularity" in rate:
        p.block.granularity = p.enum(rate["granularity"], f"{where}.granularity", RATE_GRANULARITIES)


def _scale(p: _Parser, value: Any, where: str) -> None:
    scale = p.obj(value, where, set(SCALE_FAMILIES))
    if scale is None:
        return
    for family in SCALE_FAMILIES:
        if family not in scale:
            continue
        f = p.obj(scale[family], f"{where}.{family}", {"vectors", "gains"})
        if f is None:
            continue
        if "vectors" in f and p.enum(f["vectors"], f"{where}.{family}.vectors", SCALE_GRANULARITIES) == "none":
            p.bad("vectors-none", f"{where}.{family}.vectors", "scale vectors cannot be none", "uniform, per_layer "
                  "or per_expert", "none")
        if "gains" in f:
            p.enum(f["gains"], f"{where}.{family}.gains", SCALE_GRANULARITIES)


def _transform(p: _Parser, value: Any, where: str) -> None:
    transform = p.obj(value, where, {"projection", "expert"})
    if transform is None:
        return
    if "projection" in transform:
        proj = p.obj(transform["projection"], f"{where}.projection", {"kind"}, {"block_size"})
        if proj is not None and "kind" in proj:
            if proj["kind"] == "none":
                if "block_size" in proj:
                    p.bad("block-size", f"{where}.projection.block_size", "no block_size when kind is none",
                          "absent", _shown(proj["block_size"]))
            elif proj["kind"] != "scaled_hadamard":
                p.bad("enum", f"{where}.projection.kind", "not a projection transform", "none, scaled_hadamard",
                      _shown(proj["kind"]))
            elif "block_size" not in proj:
                p.bad("missing-field", f"{where}.projection.block_size", "scaled_hadamard needs block_size")
            else:
                p.power_of_two(proj["block_size"], f"{where}.projection.block_size")
    if "expert" in transform:
        era = p.era
        keys = {"pre_block_size", "post_block_size", era.granularity_key}
        expert = p.obj(transform["expert"], f"{where}.expert", {"kind"}, keys)
        if expert is None or "kind" not in expert:
            return
        if expert["kind"] == "none":
            for key in sorted(set(expert) - {"kind"}):
                p.bad("expert-fields", f"{where}.expert.{key}", "no other field when kind is none", "absent")
        elif expert["kind"] != era.expert_kind:
            p.bad("enum", f"{where}.expert.kind", f"not an expert transform of {era.release}",
                  f"none, {era.expert_kind}", _shown(expert["kind"]))
        else:
            for key in sorted(keys - set(expert)):
                p.bad("missing-field", f"{where}.expert.{key}", f"{era.expert_kind} needs it")
            for key in ("pre_block_size", "post_block_size"):
                if key in expert:
                    p.power_of_two(expert[key], f"{where}.expert.{key}")
            if era.granularity_key in expert and expert[era.granularity_key] != "per_expert":
                p.bad("enum", f"{where}.expert.{era.granularity_key}", "sign draws are per expert", "per_expert",
                      _shown(expert[era.granularity_key]))


def rate_shape(block: Block, layers: int, experts: int, intermediate: int) -> tuple[int, ...] | None:
    """The model-level rate tensor's shape (TrellisRateConfig.tensor_shape); None when the group size does not
    divide the intermediate size."""
    base = {"uniform": (1,), "per_layer": (layers,), "per_expert": (layers, experts),
            "per_expert_projection": (layers, experts, 3)}[block.granularity or "uniform"]
    if block.group_size is None:
        return base
    if intermediate % block.group_size:
        return None
    return base + (intermediate // block.group_size,)


def atom_reasons(block: Block, rates: list[int] | None) -> list[str]:
    """Why the atom layout is selected (it runs on sm_103 only, in b12x's repository), [] when it is not."""
    why = []
    if block.group_size is not None:
        why.append(f"rate.group_size {block.group_size} (per-group rates)")
    if rates:
        uneven = sorted({r for r in rates if r >> 4 != r & 0xF})
        if uneven:
            why.append(f"unequal nibbles (0x{uneven[0]:02x})")
        ks = sorted({k for r in rates for k in (r >> 4, r & 0xF)})
        if block.codebook == "mcg" and any(k not in MIXED_TIERS for k in ks):
            why.append(f"mcg K{[k for k in ks if k not in MIXED_TIERS][0]} (the tiered path takes K3/K4/K5)")
        elif block.codebook not in (None, "mcg") and len(ks) > 1:
            why.append(f"{block.codebook} with several K {ks}")
    return why
