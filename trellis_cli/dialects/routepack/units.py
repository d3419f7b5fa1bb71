"""A route pack as diff's logical units: each unit a run of bytes in its layer file, found from the manifest's
geometry and tiers and the file's header (dialects/units.py says what a unit is)."""

from __future__ import annotations

import math
from typing import Any

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, TensorRef
from trellis_cli.checkpoint.reader import shard_header
from trellis_cli.dialects.units import (CODES, HIDDEN, INTERMEDIATE, Key, Span, Unit, header_tensors, named_units,
                                        native_shape, where)
from trellis_cli.dialects.routepack.declared import manifest_of
from trellis_cli.errors import CheckFailed
from trellis_cli.formats.layer_pack import MAX_TIER_EXPERTS, ROT_DOWN_SVH, ROT_GATE_SUH, ROT_INTERMEDIATE, ROT_UP_SUH, tier_trellis_name
from trellis_cli.dialects.routepack.layout import layer_file_name
from trellis_cli.id_ranges import expand_ranges

HIDDEN_TABLES = (ROT_GATE_SUH, ROT_UP_SUH, ROT_DOWN_SVH)  # in projection order
MAX_TIERS = 8  # K is 1..8 bits
EXTRA_DIR = "extra/"  # where a route pack carries the source's non-expert tensors


def manifest_layers(ck: Checkpoint) -> list[int]:
    """The MoE layers the manifest lists (its layer keys that are numbers)."""
    layers = (manifest_of(ck) or {}).get("layers")
    return sorted(int(k) for k in layers if str(k).isdigit()) if isinstance(layers, dict) else []


def layer_units(ck: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
    if tp != ck.tp:
        raise CheckFailed(f"{where(ck)} is a route pack at TP {ck.tp}; its ranks cannot be compared at TP "
                          f"{tp} (convert one side with `trellis repack --to tr3 --tp {tp}`)")
    doc = manifest_of(ck) or {}
    geometry: Any = doc.get("geometry") or {}
    hidden, width = geometry.get("hidden"), geometry.get("intermediate_rank")
    layers: Any = doc.get("layers") if isinstance(doc.get("layers"), dict) else {}
    entry = layers.get(str(layer))
    tiers = entry.get("tiers") if isinstance(entry, dict) else None
    if not _multiple_of_16(hidden) or not _multiple_of_16(width) or not isinstance(tiers, list):
        raise CheckFailed(f"{where(ck)}: manifest.json has no usable geometry or tiers for layer {layer} "
                          f"(run `trellis validate`)")
    if len(tiers) > MAX_TIERS:  # bounded work whatever the manifest says
        raise CheckFailed(f"{where(ck)}: manifest.json layer {layer} lists {len(tiers)} tiers, more than the "
                          f"{MAX_TIERS} K values EXL3 has (run `trellis validate`)")
    order = []  # combined order: (tier, local, expert, K)
    for t, tier in enumerate(tiers):
        try:
            ids = expand_ranges(str(tier.get("experts", "")), limit=MAX_TIER_EXPERTS) \
                if isinstance(tier, dict) else []
        except ValueError as e:
            raise CheckFailed(f"{where(ck)}: manifest.json layer {layer} tier {t}: {e} (run `trellis validate`)")
        order += [(t, local, expert, tier.get("k")) for local, expert in enumerate(ids)]
    units: dict[Key, Unit] = {}
    for rank in range(ck.tp):
        name = layer_file_name(layer, rank)
        if name not in ck.files or ck.files[name] < 0:
            continue  # its units are absent: reported as only in the other side
        header = shard_header(ck, name)
        units.update(_file_units(header, name, order, rank, hidden, width))
    return units


def _file_units(header: Any, name: str, order: list, rank: int, hidden: int, width: int) -> dict[Key, Unit]:
    """One layer file's units; a tensor whose dtype or shape does not hold the unit leaves it out (absent),
    so no unit ever reads bytes of another tensor."""
    entries, start = header.tensors, header.data_start
    served = len(order)
    inter = _entry(entries, ROT_INTERMEDIATE, "F16", (served, 3, width))
    tables = [entries.get(n) for n in HIDDEN_TABLES]
    tables = [t if t is not None and t.dtype == "F16" and tuple(t.shape) in ((served, hidden), (1, hidden)) else None
              for t in tables]
    units: dict[Key, Unit] = {}
    for combined, (t, local, expert, k) in enumerate(order):
        slab = entries.get(tier_trellis_name(t))
        for p, proj in enumerate(PROJECTIONS):
            if isinstance(k, int) and k > 0 and slab is not None and slab.dtype == "I16" and \
                    len(slab.shape) == 4 and local < slab.shape[0] and slab.shape[1] == 3 and \
                    slab.end - slab.begin == 2 * math.prod(slab.shape):
                size = slab.shape[2] * slab.shape[3] * 2
                begin = start + slab.begin + (local * 3 + p) * size
                units[expert, proj, rank, CODES] = Unit(slab.dtype, native_shape(proj, hidden, width, k), size,
                                                        Span(name, begin, begin + size))
            if inter is not None:
                begin = start + inter.begin + (combined * 3 + p) * width * 2
                units[expert, proj, rank, INTERMEDIATE] = Unit(inter.dtype, (width,), width * 2,
                                                               Span(name, begin, begin + width * 2))
            table = tables[p]
            if table is not None:
                row = combined if table.shape[0] > 1 else 0
                begin = start + table.begin + row * hidden * 2
                units[expert, proj, rank, HIDDEN] = Unit(table.dtype, (hidden,), hidden * 2,
                                                         Span(name, begin, begin + hidden * 2))
    return units


def _multiple_of_16(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 and value % 16 == 0


def _entry(entries: dict, name: str, dtype: str, shape: tuple[int, ...]) -> Any:
    entry = entries.get(name)
    ok = entry is not None and entry.dtype == dtype and tuple(entry.shape) == shape and \
        entry.end - entry.begin == 2 * math.prod(shape)
    return entry if ok else None


def loose_tensors(ck: Checkpoint) -> list[TensorRef]:
    """The source's non-expert tensors the pack carries under extra/ (its top-level layer files left out)."""
    layer_files = {name for name in ck.files if name.startswith("layer-") and "/" not in name}
    return [ref for ref in header_tensors(ck, layer_files) if ref.file.startswith(EXTRA_DIR)]


def other_units(ck: Checkpoint) -> dict[Key, Unit]:
    return named_units(loose_tensors(ck))
