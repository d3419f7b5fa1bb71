"""What a TR3 config.json declares: the `hybrid_tr3_tail` contract (detection: format, rotation layout, TP,
codebook) and the K per expert of every MoE layer (`bits`, `trellis_bits_by_layer`, or the tier bitmap that
`bits_per_expert` names, with the `tail_tr3`-of-length-E fallback meaning all K3).

Problems with the K declarations become findings (codes `bitmap.*`), never exceptions; a contract that claims
TR3 but cannot be read as it is an UnknownDialect naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from trellis_cli.checkpoint.declared import Declared, layer_range, uniform_bits
from trellis_cli.checkpoint.model import DIALECT_TR3_PER_EXPERT, DIALECT_TR3_SHARED_H, Checkpoint, Declarations
from trellis_cli.dialects.interface import DialectInfo, Probe, declared_tp
from trellis_cli.errors import CheckFailed, SourceUnavailable, UnknownDialect
from trellis_cli.findings import Location, error, error_summary, missing_ids, warning
from trellis_cli.header import coerced_int
from trellis_cli.id_ranges import parse_id

TR3_FORMAT = "exl3-trellis"
ROTATION_LAYOUTS = {"per_expert_v1": DIALECT_TR3_PER_EXPERT, "shared_h_v1": DIALECT_TR3_SHARED_H}
# The K a TR3 config can declare (validate/rules_config.py checks the same sets; a test keeps them equal): one K
# for every expert as `bits`, or several as `k_values`. A conversion to TR3 refuses any other K before writing.
TR3_UNIFORM_K = (3, 4, 5, 6, 8)
TR3_MIXED_K = range(3, 7)
TAIL_FALLBACK_K = 3  # a tail_tr3 list covering every expert means "all trellis-3" (the MTP overlay)


@dataclass
class Tr3Declarations(Declarations):
    """config.json's `hybrid_tr3_tail`, an object (detection takes the checkpoint for TR3 only then)."""

    hybrid: dict[str, Any]


def contract_of(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The TR3 checkpoint's hybrid_tr3_tail as opening read it; None for any other checkpoint."""
    declared = ckpt.declared
    return declared.hybrid if isinstance(declared, Tr3Declarations) else None


def detect_tr3(probe: Probe) -> DialectInfo | None:
    """TR3 when config.json has hybrid_tr3_tail (either rotation layout); UnknownDialect when it cannot be read."""
    if probe.config is None or probe.config.get("hybrid_tr3_tail") is None:
        return None
    hybrid = probe.config["hybrid_tr3_tail"]
    if not isinstance(hybrid, dict):
        raise UnknownDialect(f"config.json: hybrid_tr3_tail is a JSON {type(hybrid).__name__}, expected an object")
    if not isinstance(hybrid.get("format"), str) or hybrid.get("format") != TR3_FORMAT:
        raise UnknownDialect(
            f"config.json: hybrid_tr3_tail.format is {hybrid.get('format')!r}, expected {TR3_FORMAT!r}")
    layout = hybrid.get("rotation_layout", "per_expert_v1")
    if not isinstance(layout, str) or layout not in ROTATION_LAYOUTS:
        raise UnknownDialect(f"config.json: hybrid_tr3_tail.rotation_layout is {layout!r}, "
                             f"expected one of {', '.join(ROTATION_LAYOUTS)}")
    codebook = hybrid.get("codebook")
    embedded = probe.embedded()
    if codebook is None and embedded is not None:
        codebook = embedded.get("codebook")
    return DialectInfo(ROTATION_LAYOUTS[layout], layout, declared_tp(hybrid.get("tp")),
                       codebook if isinstance(codebook, str) else None, Tr3Declarations(hybrid))


def k_declared(hybrid: dict[str, Any], read_json: Callable[[str], Any], files: dict[str, int], limit: int) -> Declared:
    """K per expert of every layer the contract declares: `bits: "mixed"` through the tier bitmap its
    `bits_per_expert` names, else `trellis_bits_by_layer`, else one uniform `bits`.

    `limit`: Checkpoint.count_limit. Counts above it are reported by open.py; here they declare nothing."""
    out = Declared()
    bits = hybrid.get("bits")
    experts = coerced_int(hybrid.get("experts_per_layer"))
    experts = experts if experts is not None and experts <= limit else None
    layers = layer_range(hybrid.get("moe_layers"), limit)
    if isinstance(bits, str) and bits.lower().startswith("mixed"):
        _load_bitmap(out, hybrid.get("bits_per_expert"), read_json, files, experts, layers)
        return out
    by_layer = hybrid.get("trellis_bits_by_layer")
    if isinstance(by_layer, dict):
        for key, k in by_layer.items():
            layer = parse_id(key)  # loaders look up str(layer): "03" is no layer (rules_config reports the keys)
            if layer is not None and experts is not None and experts > 0:
                out.expert_k[layer] = [k] * experts
                out.k_source[layer] = "trellis_bits_by_layer"
        return out
    uniform = uniform_bits(bits)
    if uniform is not None and experts is not None and experts > 0:
        for layer in layers:
            out.expert_k[layer] = [uniform] * experts
            out.k_source[layer] = "bits"
    return out


def _load_bitmap(out: Declared, ref: Any, read_json: Callable[[str], Any], files: dict[str, int],
                 experts: int | None, layers: range) -> None:
    where = Location(file="config.json", tensor="hybrid_tr3_tail.bits_per_expert")
    if not isinstance(ref, str) or ":" not in ref:
        out.findings.append(error("bitmap.reference", where, "bits_per_expert must be a 'file.json:field' reference",
                                  expected="'tier_bitmap.json:k'", found=ref))
        return
    name, fieldname = ref.rsplit(":", 1)
    if name not in files:
        out.findings.append(error("bitmap.missing", Location(file=name), "the bitmap file named by bits_per_expert "
                                  "is not in the checkpoint", expected=name, found="no such file"))
        return
    try:
        bitmap = read_json(name)
    except (CheckFailed, SourceUnavailable) as e:
        out.findings.append(error("bitmap.unreadable", Location(file=name), str(e).split(": ", 1)[-1]))
        return
    if not isinstance(bitmap, dict):
        out.findings.append(error("bitmap.unreadable", Location(file=name), "bitmap is not a JSON object",
                                  expected="object", found=type(bitmap).__name__))
        return
    for key, entry in bitmap.items():
        layer = parse_id(key)
        if layer is None:  # loaders look up str(layer): "03", "٣" or "３" is no layer to them
            out.findings.append(warning("bitmap.key", Location(file=name), "bitmap key is not a canonical decimal "
                                        "layer index (loaders look entries up by str(layer)): ignored", found=key))
            continue
        if not isinstance(entry, dict):
            out.findings.append(error("bitmap.entry", Location(file=name, layer=layer), "layer entry is not an object",
                                      found=type(entry).__name__))
            continue
        if fieldname in entry:
            out.expert_k[layer] = entry[fieldname] if isinstance(entry[fieldname], list) else [entry[fieldname]]
            out.k_source[layer] = f"{name}:{fieldname}"
        elif isinstance(entry.get("tail_tr3"), list) and len(entry["tail_tr3"]) == experts:
            out.expert_k[layer] = [TAIL_FALLBACK_K] * experts
            out.k_source[layer] = f"{name}:tail_tr3"
        else:
            out.findings.append(error("bitmap.field", Location(file=name, layer=layer),
                                      f"layer entry has no {fieldname!r} list (nor a full tail_tr3 list)",
                                      expected=fieldname, found=sorted(entry)))
    listed = {layer for layer in map(parse_id, bitmap) if layer is not None}
    first, total = missing_ids(layers, listed)
    for layer in first:
        out.findings.append(error("bitmap.layer-missing", Location(file=name, layer=layer),
                                  "moe_layers includes this layer but the bitmap has no entry for it"))
    if total > len(first):
        out.findings.append(error_summary("bitmap.layer-missing", Location(file=name), total - len(first),
                                          "moe_layers without a bitmap entry", expected=f"{len(layers)} layers",
                                          found=f"{len(layers) - total} listed"))
