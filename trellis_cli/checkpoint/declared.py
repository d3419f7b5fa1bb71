"""Declared bitrates, as every dialect's declarations hand them to the shared opening, and the value readers
they share.

Each dialect parses its own metadata in its own package (dialects/tr3/declared.py: the `hybrid_tr3_tail` K
per expert and its tier bitmaps; dialects/r7/declared.py: the per-layer bit-map manifests; dialects/exl3/
declared.py: `tensor_storage` per module) into a `Declared`: K per expert or per (expert, projection) for each
layer, where each layer's came from, and the problems met, as findings (codes `bitmap.*`), never exceptions, so
the rest of the checkpoint still gets checked. dialects/open.py applies it to the model's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trellis_cli.findings import Finding
from trellis_cli.header import coerced_int
from trellis_cli.id_ranges import parse_id


@dataclass
class Declared:
    """Per-layer declarations collected for one checkpoint (`Dialect.declarations`)."""

    expert_k: dict[int, list[Any]] = field(default_factory=dict)  # layer -> K per expert (raw: validate checks)
    projection_k: dict[int, dict[tuple[int, str], int]] = field(default_factory=dict)  # layer -> (E, proj) -> K
    k_source: dict[int, str] = field(default_factory=dict)  # layer -> where the K list came from
    findings: list[Finding] = field(default_factory=list)


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
    return int(bits) if is_integral(bits) else None


def is_integral(value: Any) -> bool:
    """An int or an integral float (never a bool): how the loaders that coerce with int() accept a count."""
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
