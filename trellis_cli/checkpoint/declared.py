"""Declared bitrates: what the metadata says each expert (or projection) should be, per layer.

Sources by dialect: TR3 mixed -> the `bits_per_expert` reference ("tier_bitmap.json:k" or ":bits_per_expert",
with the `tail_tr3`-of-length-E fallback meaning all K3); TR3 uniform -> `bits` or `trellis_bits_by_layer`;
plain exllamav3 -> `tensor_storage[...].bits_per_weight` per module; R7 -> the per-layer bit-map manifests.
Problems become findings (codes `bitmap.*`), never exceptions: the rest of the checkpoint still gets checked.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from trellis_cli.checkpoint.names import PROJECTIONS_BY_INDEX, parse_expert_name
from trellis_cli.errors import CheckFailed, SourceUnavailable
from trellis_cli.findings import Finding, Location, error, error_summary, missing_ids, warning
from trellis_cli.header import coerced_int, is_int
from trellis_cli.id_ranges import parse_id

# The K a TR3 config can declare (validate/rules_config.py checks the same sets; a test keeps them equal): one K
# for every expert as `bits`, or several as `k_values`. A conversion to TR3 refuses any other K before writing.
TR3_UNIFORM_K = (3, 4, 5, 6, 8)
TR3_MIXED_K = range(3, 7)
TAIL_FALLBACK_K = 3  # a tail_tr3 list covering every expert means "all trellis-3" (the MTP overlay)


class Declared:
    """Per-layer declarations collected for one checkpoint."""

    def __init__(self) -> None:
        self.expert_k: dict[int, list[Any]] = {}  # layer -> K per expert (raw values; validate checks them)
        self.projection_k: dict[int, dict[tuple[int, str], int]] = {}
        self.k_source: dict[int, str] = {}  # layer -> where the K list came from
        self.findings: list[Finding] = []


def tr3_declared(hybrid: dict, read_json: Callable[[str], Any], files: dict[str, int], limit: int) -> Declared:
    """`limit`: Checkpoint.count_limit. Counts above it are reported by open.py; here they declare nothing."""
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


def _load_bitmap(out: Declared, ref: Any, read_json, files, experts: int | None, layers: range) -> None:
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


def exl3_declared(quant_config: dict | None) -> Declared:
    """Per-projection K from quantization_config.json tensor_storage (bits_per_weight per module)."""
    out = Declared()
    storage = (quant_config or {}).get("tensor_storage")
    if not isinstance(storage, dict):
        return out
    for module, record in storage.items():
        if not isinstance(record, dict) or record.get("quant_format") != "exl3":
            continue
        parsed = parse_expert_name(f"{module}.trellis")
        if parsed is None or parsed.kind != "linear" or not _is_integral(record.get("bits_per_weight")):
            continue
        out.projection_k.setdefault(parsed.layer, {})[(parsed.expert, parsed.projection)] = int(
            record["bits_per_weight"])
    return out


_MANIFEST_LAYER = re.compile(r"layer-([0-9]+)")  # a file name: zero-padded, ASCII


def r7_declared(r7: dict, read_json: Callable[[str], Any], files: dict[str, int]) -> Declared:
    """R7 per-layer maps: 768 entries (experts x projections), as a list or a {"E.proj"|E: ...} mapping."""
    out = Declared()
    # The R7 loader reads each tensor's K from its trellis shape, not from these maps: without them nothing is
    # declared to compare the shapes with, which is a warning, not a refusal.
    manifests = r7.get("bit_map_manifests")
    if not isinstance(manifests, list):
        out.findings.append(warning("bitmap.reference", Location(file="config.json", tensor="r7_routed_experts"),
                                    "bit_map_manifests is not a list of file names: no declared K to compare the "
                                    "trellis shapes with (the R7 loader reads K from the shapes)",
                                    found=type(manifests).__name__))
        return out
    for name in manifests:
        m = _MANIFEST_LAYER.search(str(name))
        if name not in files or m is None:
            out.findings.append(warning("bitmap.missing", Location(file=str(name)), "R7 bit map manifest not "
                                        "found (the R7 loader does not read it; its layer has no declared K)"))
            continue
        try:
            data = read_json(name)
        except (CheckFailed, SourceUnavailable) as e:
            out.findings.append(error("bitmap.unreadable", Location(file=name), str(e).split(": ", 1)[-1]))
            continue
        layer = data.get("layer", m.group(1)) if isinstance(data, dict) else m.group(1)
        if isinstance(layer, str) and layer.isascii() and layer.isdecimal():
            layer = int(layer)  # a value (the file's own "layer"), not a key looked up: padding allowed
        if not is_int(layer) or layer < 0:  # the file's own "layer" wins over its name, so it must be a number
            out.findings.append(error("bitmap.unreadable", Location(file=name), "\"layer\" is not a layer number",
                                      "a decimal layer index", repr(layer)[:60]))
            continue
        out.projection_k[layer] = _r7_map(data)
        out.k_source[layer] = name
    return out


def _r7_map(data: Any) -> dict[tuple[int, str], int]:
    if isinstance(data, dict):
        data = next((data[k] for k in ("bits", "k", "map", "bit_map") if k in data), data)
    result: dict[tuple[int, str], int] = {}
    if isinstance(data, list):
        for i, k in enumerate(data):
            result[(i // 3, PROJECTIONS_BY_INDEX[i % 3])] = k
    elif isinstance(data, dict):
        for key, value in data.items():
            if isinstance(value, dict):  # {E: {proj: K}}
                for proj, k in value.items():
                    if parse_id(key) is not None:
                        result[(parse_id(key), proj)] = k
            elif "." in str(key) and parse_id(str(key).split(".")[0]) is not None:  # {"E.proj": K}
                e, proj = str(key).split(".", 1)
                result[(parse_id(e), proj)] = value
    return result


def layer_range(moe_layers: Any, limit: int | None = None) -> range:
    """`moe_layers` [first, last] as a lazy range; empty when malformed, or longer than `limit`."""
    span = layer_span(moe_layers)
    if span == 0 or (limit is not None and span > limit):
        return range(0)
    first = coerced_int(moe_layers[0])
    assert first is not None
    return range(first, first + span)


def layer_span(moe_layers: Any) -> int:
    """How many layers `moe_layers` [first, last] names (0 when malformed), by arithmetic: len() of a range
    longer than sys.maxsize raises, and a config may say [3, 10**30]."""
    if not isinstance(moe_layers, list) or len(moe_layers) != 2:
        return 0
    first, last = (coerced_int(v) for v in moe_layers)  # "3" and 3.0 as int() reads them (#190)
    if first is None or last is None or not 0 <= first <= last:
        return 0
    return last - first + 1


def uniform_bits(bits: Any) -> int | None:
    """A uniform `bits` as the #190 loader reads it (float(), then integral): 4, 4.0 and "4" are K4."""
    if isinstance(bits, str) and len(bits) <= 32:
        try:
            bits = float(bits)
        except ValueError:
            return None
    return int(bits) if _is_integral(bits) else None


def _is_integral(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and value.is_integer()


def bits_map_overrides(hybrid: Any) -> dict[int, Any]:
    """Layers where a uniform checkpoint's trellis_bits_by_layer says another K than its integral `bits`:
    layer -> the map's K. The loader versions read one field each (#190 and R7: bits for every layer; shared-H:
    the map), so such a layer is judged per loader, not by the format rules."""
    if not isinstance(hybrid, dict):
        return {}
    bits, by_layer = uniform_bits(hybrid.get("bits")), hybrid.get("trellis_bits_by_layer")
    if bits is None or not isinstance(by_layer, dict):  # "mixed" is no uniform bits
        return {}
    found = {}
    for key, k in by_layer.items():
        layer = parse_id(key)
        if layer is not None and k != bits:
            found[layer] = k
    return found
