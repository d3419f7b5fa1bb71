"""exl3-manifest.json, parsed strictly: every rule of the b12x 1.5.1 parser plus the gaps it leaves open.

Stricter than that parser on purpose (docs/findings.md, `exl3v1.*`): JSON booleans and floats are not
integers, layer keys must be canonical decimals ("3", never "03"), sha256 must be 64 lowercase hex digits,
a layer `file` must stay inside the directory, and `per_expert_pair` needs whole 8-slot pairs. Parsing never
raises; it returns a Manifest when the parts later rules need are usable, and every problem as a finding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from trellis_cli.findings import Finding, Location, error
from trellis_cli.header import safe_relative

MANIFEST_FILE = "exl3-manifest.json"
KIND = "exl3-manifest"
SCHEMA = "exl3-v1"
SLOT_CHANNELS = 32
SLOTS_PER_PAIR = 8
HADAMARD_BLOCK_SLOTS = 4  # the implicit 128-channel intermediate Hadamard block, in slots
MCG_SEED = 0xCBAC1FED
UNIFORM, PER_EXPERT_PAIR = "uniform", "per_expert_pair"
PAIR_KINDS = {"P22": 0x22, "P33": 0x33, "P24": 0x24, "P43": 0x43, "P44": 0x44}  # name -> (low << 4) | high
KIND_OF_CODE = {code: name for name, code in PAIR_KINDS.items()}
CODEBOOK_BITS = {"mcg": range(2, 7), "lut_e4m3": range(2, 5), "lut_fp16": range(5, 7)}
SHA256 = re.compile(r"[0-9a-f]{64}")
CANONICAL_INT = re.compile(r"0|[1-9][0-9]*")
# Named limits, checked before anything loops over slots or experts or reads a rate table: every later step
# (row checks, rate tables, TP extents, inspect) costs time and memory in proportion to these counts, and a
# few bytes of JSON can declare any count. GLM-5.x: 64 slots x 256 experts, far below each.
MAX_SLOTS = 1 << 14  # an intermediate size of 524,288 channels
MAX_EXPERTS = 1 << 13
MAX_HIDDEN = 1 << 17  # a hidden-side table row is read whole; GLM-5.x: 6144
MAX_SLOT_EXPERTS = 1 << 20  # slots x experts: the bundles of one layer, and 8x its rate-table bytes
MAX_LAYER_INDEX = (1 << 16) - 1  # as every --layers range; also keeps int() of a layer key short

TOP_KEYS = ({"kind", "schema", "codebook", "geometry", "rates", "hadamard", "layout", "layers"}, {"codebook_seed"})
GEOMETRY_KEYS: tuple[set[str], set[str]] = ({"num_experts", "hidden_size", "intermediate_size", "slot_channels", "num_slots",
                  "moe_layer_indices"}, set())
RATES_KEYS = ({"structure"}, {"bits", "pair_kinds"})
HADAMARD_KEYS = ({"intermediate_hadamard", "per_expert_input_rotations"}, {"pre_block", "post_block"})
LAYOUT_KEYS = ({"row_alignment", "extent_alignment_slots"}, {"extent_barriers"})
LAYER_KEYS: tuple[set[str], set[str]] = ({"file", "sha256"}, set())


def rate_bits(code: int) -> tuple[int, int]:
    """(low-record bits, high-record bits) of a rate byte."""
    return code >> 4, code & 0xF


@dataclass(frozen=True)
class LayerEntry:
    file: str
    sha256: str


@dataclass
class Manifest:
    """The parsed manifest (only values that passed their rules)."""

    codebook: str
    num_experts: int
    hidden: int
    intermediate: int  # global, pre-TP
    num_slots: int
    layer_indices: tuple[int, ...]
    structure: str
    bits: int | None  # uniform only
    pair_kinds: tuple[str, ...]  # per_expert_pair only
    intermediate_hadamard: bool
    per_expert_input_rotations: bool
    pre_block: int | None
    post_block: int | None
    row_alignment: int
    extent_alignment: int
    barriers: tuple[int, ...]
    layers: dict[int, LayerEntry] = field(default_factory=dict)
    codebook_seed: int | None = None

    @property
    def pairs(self) -> int:
        return self.num_slots // SLOTS_PER_PAIR

    @property
    def pair_structure(self) -> bool:
        return self.structure == PER_EXPERT_PAIR


def is_int(value: Any) -> bool:
    """A JSON integer: Python's bool is an int, and 4.0 is a float; neither passes."""
    return isinstance(value, int) and not isinstance(value, bool)


class _Parser:
    def __init__(self, file: str) -> None:
        self.file = file
        self.findings: list[Finding] = []

    def bad(self, code: str, key: str, message: str, expected: Any = None, found: Any = None) -> None:
        self.findings.append(error(code, Location(file=self.file, tensor=key), message, expected, found))

    def obj(self, value: Any, key: str, keys: tuple[set[str], set[str]]) -> dict | None:
        if not isinstance(value, dict):
            self.bad("exl3v1.type", key, "not a JSON object", "object", type(value).__name__)
            return None
        required, optional = keys
        for name in sorted(required - set(value)):
            self.bad("exl3v1.key-missing", f"{key}.{name}" if key else name, "required key is missing")
        for name in sorted(set(value) - required - optional):
            self.bad("exl3v1.key-unknown", f"{key}.{name}" if key else name, "key is not part of exl3-v1 "
                     "(the reader refuses unknown keys)")
        return value

    def positive(self, value: Any, key: str) -> int | None:
        if not is_int(value) or value <= 0:
            self.bad("exl3v1.type", key, "must be a positive JSON integer (not a boolean, float or string)",
                     "positive integer", _shown(value))
            return None
        return value

    def boolean(self, value: Any, key: str) -> bool | None:
        if not isinstance(value, bool):
            self.bad("exl3v1.type", key, "must be a JSON boolean", "true or false", _shown(value))
            return None
        return value


def parse_manifest(doc: Any, file: str = MANIFEST_FILE) -> tuple[Manifest | None, list[Finding]]:
    """(the manifest, or None when geometry, rates, hadamard or layout are unusable; every finding)."""
    p = _Parser(file)
    top = p.obj(doc, "", TOP_KEYS)
    if top is None:
        return None, p.findings
    for key, want in (("kind", KIND), ("schema", SCHEMA)):
        if top.get(key) != want:
            p.bad("exl3v1.identity", key, "identity string differs", want, _shown(top.get(key)))
    codebook = _codebook(p, top)
    geometry = _geometry(p, top.get("geometry"))
    rates = _rates(p, top.get("rates"), codebook) if "rates" in top else None
    hadamard = _hadamard(p, top.get("hadamard"), geometry) if "hadamard" in top else None
    layout = _layout(p, top.get("layout"), geometry, rates) if "layout" in top else None
    if codebook is None or geometry is None or rates is None or hadamard is None or layout is None:
        return None, p.findings
    manifest = Manifest(codebook=codebook, codebook_seed=top.get("codebook_seed"), **geometry, **rates,
                        **hadamard, **layout)
    manifest.layers = _layers(p, top.get("layers"), manifest.layer_indices)
    return manifest, p.findings


def _codebook(p: _Parser, top: dict) -> str | None:
    codebook = top.get("codebook")
    if codebook not in CODEBOOK_BITS:
        p.bad("exl3v1.codebook", "codebook", "unknown codebook (names are case-sensitive)",
              ", ".join(CODEBOOK_BITS), _shown(codebook))
        return None
    seed = top.get("codebook_seed")
    if codebook == "mcg" and (not is_int(seed) or seed != MCG_SEED):
        p.bad("exl3v1.codebook-seed", "codebook_seed", "mcg needs its multiplier seed", MCG_SEED, _shown(seed))
        return None
    if codebook != "mcg" and "codebook_seed" in top:
        p.bad("exl3v1.codebook-seed", "codebook_seed", f"only mcg has a seed; {codebook} must not declare one",
              "absent", _shown(seed))
        return None
    return codebook


def _geometry(p: _Parser, value: Any) -> dict | None:
    g = p.obj(value, "geometry", GEOMETRY_KEYS)
    if g is None:
        return None
    names = ("num_experts", "hidden_size", "intermediate_size", "slot_channels", "num_slots")
    ints: dict[str, Any] = {name: p.positive(g.get(name), f"geometry.{name}") for name in names if name in g}
    layers = _layer_indices(p, g.get("moe_layer_indices")) if "moe_layer_indices" in g else None
    if len(ints) < len(names) or None in ints.values() or layers is None:
        return None
    hidden, inter, slots = ints["hidden_size"], ints["intermediate_size"], ints["num_slots"]
    ok = True
    for bad, key, message, expected, found in (
            (ints["slot_channels"] != SLOT_CHANNELS, "slot_channels", "a slot is 32 channels", SLOT_CHANNELS,
             ints["slot_channels"]),
            (slots * SLOT_CHANNELS != inter, "num_slots", "num_slots x 32 must equal intermediate_size",
             inter // SLOT_CHANNELS if inter % SLOT_CHANNELS == 0 else "intermediate_size a multiple of 32", slots),
            (hidden % 16 != 0, "hidden_size", "hidden_size must be a multiple of 16", "multiple of 16", hidden)):
        if bad:
            p.bad("exl3v1.geometry", f"geometry.{key}", message, expected, found)
            ok = False
    experts = ints["num_experts"]
    for bad, key, message, expected, found in (
            (slots > MAX_SLOTS, "num_slots", "more slots than trellis checks", f"<= {MAX_SLOTS}", slots),
            (experts > MAX_EXPERTS, "num_experts", "more experts than trellis checks", f"<= {MAX_EXPERTS}", experts),
            (hidden > MAX_HIDDEN, "hidden_size", "a larger hidden size than trellis checks", f"<= {MAX_HIDDEN}",
             hidden),
            (slots * experts > MAX_SLOT_EXPERTS, "num_slots", "more slots x experts than trellis checks",
             f"<= {MAX_SLOT_EXPERTS}", slots * experts)):
        if bad:
            p.bad("exl3v1.too-large", f"geometry.{key}", f"{message} (a named limit: no real MoE layer comes "
                  "near it, and the checks' work grows with it)", expected, found)
            ok = False
            break
    if not ok:
        return None
    return {"num_experts": ints["num_experts"], "hidden": hidden, "intermediate": inter, "num_slots": slots,
            "layer_indices": layers}


def _layer_indices(p: _Parser, value: Any) -> tuple[int, ...] | None:
    if (not isinstance(value, list) or not value or not all(is_int(v) and 0 <= v <= MAX_LAYER_INDEX for v in value)
            or len(set(value)) != len(value)):
        p.bad("exl3v1.geometry", "geometry.moe_layer_indices", "must be a non-empty list of distinct non-negative "
              f"integers up to {MAX_LAYER_INDEX}", "e.g. [3, 4, 5]", _shown(value))
        return None
    return tuple(sorted(value))


def _rates(p: _Parser, value: Any, codebook: str | None) -> dict | None:
    r = p.obj(value, "rates", RATES_KEYS)
    if r is None:
        return None
    structure = r.get("structure")
    allowed = CODEBOOK_BITS.get(codebook or "", range(2, 7))
    if structure == UNIFORM:
        if "pair_kinds" in r or "bits" not in r:
            p.bad("exl3v1.rates", "rates", "uniform declares bits and no pair_kinds", "bits only", sorted(r))
            return None
        bits = r["bits"]
        if not is_int(bits) or bits not in allowed:
            p.bad("exl3v1.rates", "rates.bits", f"bits must be an integer the {codebook} codebook allows",
                  f"{allowed.start}..{allowed.stop - 1}", _shown(bits))
            return None
        return {"structure": UNIFORM, "bits": bits, "pair_kinds": ()}
    if structure == PER_EXPERT_PAIR:
        kinds = r.get("pair_kinds")
        if "bits" in r or not isinstance(kinds, list) or not kinds or len(set(map(str, kinds))) != len(kinds) \
                or not all(isinstance(k, str) and k in PAIR_KINDS for k in kinds):
            p.bad("exl3v1.rates", "rates.pair_kinds", "per_expert_pair declares a non-empty list of distinct pair "
                  "kinds and no bits", ", ".join(PAIR_KINDS), _shown(kinds))
            return None
        unsuited = [k for k in kinds if any(b not in allowed for b in rate_bits(PAIR_KINDS[k]))]
        if unsuited:
            p.bad("exl3v1.rates", "rates.pair_kinds", f"pair kinds with bit widths the {codebook} codebook does not "
                  "allow", f"{allowed.start}..{allowed.stop - 1}", unsuited)
            return None
        return {"structure": PER_EXPERT_PAIR, "bits": None, "pair_kinds": tuple(sorted(kinds))}
    p.bad("exl3v1.rates", "rates.structure", "unknown rate structure", f"{UNIFORM} or {PER_EXPERT_PAIR}",
          _shown(structure))
    return None


def _hadamard(p: _Parser, value: Any, geometry: dict | None) -> dict | None:
    h = p.obj(value, "hadamard", HADAMARD_KEYS)
    if h is None:
        return None
    inter = p.boolean(h.get("intermediate_hadamard"), "hadamard.intermediate_hadamard")
    per_expert = p.boolean(h.get("per_expert_input_rotations"), "hadamard.per_expert_input_rotations")
    if inter is None or per_expert is None:
        return None
    blocks: dict[str, int | None] = {"pre_block": None, "post_block": None}
    if not inter:
        if "pre_block" in h or "post_block" in h:
            p.bad("exl3v1.hadamard", "hadamard", "blocks are declared only with intermediate_hadamard", "absent",
                  sorted(k for k in ("pre_block", "post_block") if k in h))
            return None
    else:
        for key, axis in (("pre_block", "hidden"), ("post_block", "intermediate")):
            size = p.positive(h.get(key), f"hadamard.{key}")
            if size is None or size % 32 or (geometry is not None and geometry[axis] % size):
                if size is not None:
                    p.bad("exl3v1.hadamard", f"hadamard.{key}", f"a positive multiple of 32 dividing the {axis} "
                          "size", f"divides {geometry[axis] if geometry else '?'}", size)
                return None
            blocks[key] = size
    return {"intermediate_hadamard": inter, "per_expert_input_rotations": per_expert, **blocks}


def _layout(p: _Parser, value: Any, geometry: dict | None, rates: dict | None) -> dict | None:
    lay = p.obj(value, "layout", LAYOUT_KEYS)
    if lay is None or geometry is None:
        return None
    row = p.positive(lay.get("row_alignment"), "layout.row_alignment")
    extent = p.positive(lay.get("extent_alignment_slots"), "layout.extent_alignment_slots")
    slots = geometry["num_slots"]
    if extent is not None and slots % extent:
        p.bad("exl3v1.layout", "layout.extent_alignment_slots", "must divide num_slots", f"a divisor of {slots}",
              extent)
        extent = None
    barriers = lay.get("extent_barriers", [])
    if (not isinstance(barriers, list) or not all(is_int(b) and 0 < b < slots for b in barriers)
            or len(set(barriers)) != len(barriers)):
        p.bad("exl3v1.layout", "layout.extent_barriers", "distinct integers strictly between 0 and num_slots",
              f"within 1..{slots - 1}", _shown(barriers))
        barriers = None
    if rates is not None and rates["structure"] == PER_EXPERT_PAIR and extent is not None:
        if slots % SLOTS_PER_PAIR or extent % SLOTS_PER_PAIR:
            p.bad("exl3v1.pair-alignment", "layout.extent_alignment_slots", "per_expert_pair rates are per 8-slot "
                  "pair: num_slots and the extent alignment must be multiples of 8 (else an extent splits a pair)",
                  "multiples of 8", {"num_slots": slots, "extent_alignment_slots": extent})
            extent = None
    if row is None or extent is None or barriers is None:
        return None
    return {"row_alignment": row, "extent_alignment": extent, "barriers": tuple(sorted(barriers))}


def _layers(p: _Parser, value: Any, indices: tuple[int, ...]) -> dict[int, LayerEntry]:
    if not isinstance(value, dict) or not value:
        p.bad("exl3v1.type", "layers", "must be a non-empty object of layer entries", "object", _shown(value))
        return {}
    out: dict[int, LayerEntry] = {}
    for key, entry in value.items():
        where = f"layers.{key}"
        if not _layer_key(key):
            p.bad("exl3v1.layer-key", where, "a layer key is the layer index in canonical decimal (no sign, no "
                  "leading zeros)", "e.g. \"3\"", key)
            continue
        e = p.obj(entry, where, LAYER_KEYS)
        if e is None or not LAYER_KEYS[0] <= set(e):
            continue
        file, sha = e["file"], e["sha256"]
        if isinstance(file, str) and safe_relative(file):
            # b12x joins the name onto the directory with pathlib: `./x`, `x/` and `a//x` all name file x.
            file = PurePosixPath(file).as_posix()
        if not isinstance(file, str) or not safe_relative(file) or file == ".":
            p.bad("exl3v1.file-path", f"{where}.file", "the layer file must be a relative path inside the "
                  "checkpoint directory", "relative path without ..", _shown(file))
            continue
        if not isinstance(sha, str) or not SHA256.fullmatch(sha):
            p.bad("exl3v1.sha256-format", f"{where}.sha256", "not a sha256 digest", "64 lowercase hex digits",
                  _shown(sha))
            continue
        out[int(key)] = LayerEntry(file, sha)
    declared = set(indices)
    keyed = {int(k) for k in value if _layer_key(k)}
    missing, extra = sorted(declared - keyed), sorted(keyed - declared)
    if missing or extra:
        p.bad("exl3v1.layers-mismatch", "layers", "layer keys must equal geometry.moe_layer_indices",
              "no missing or extra keys", {"missing": missing, "extra": extra})
    for layer in extra:
        out.pop(layer, None)
    return dict(sorted(out.items()))


def _layer_key(key: Any) -> bool:
    """A canonical decimal layer index within MAX_LAYER_INDEX (checked on the text: int() of thousands of
    digits raises)."""
    return (isinstance(key, str) and len(key) <= len(str(MAX_LAYER_INDEX)) and CANONICAL_INT.fullmatch(key) is not None
            and int(key) <= MAX_LAYER_INDEX)


def _shown(value: Any) -> Any:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
