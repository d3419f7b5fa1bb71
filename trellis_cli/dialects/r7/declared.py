"""What R7 metadata declares: `r7_routed_experts` in the embedded or external quantization config (detection),
and K per (expert, projection) of each layer from its bit-map manifests (768 entries, experts x projections, as a
list or a {"E.proj"|E: ...} mapping). Problems become findings (codes `bitmap.*`), never exceptions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from trellis_cli.checkpoint.declared import Declared
from trellis_cli.checkpoint.model import DIALECT_R7, Declarations
from trellis_cli.checkpoint.names import PROJECTIONS_BY_INDEX
from trellis_cli.dialects.interface import DialectInfo, Probe
from trellis_cli.errors import CheckFailed, SourceUnavailable
from trellis_cli.findings import Location, warning
from trellis_cli.header import is_int
from trellis_cli.id_ranges import parse_id


@dataclass
class R7Declarations(Declarations):
    """The `r7_routed_experts` object of the quantization config (embedded first)."""

    routed_experts: dict[str, Any]


def detect_r7(probe: Probe) -> DialectInfo | None:
    if probe.config is None:
        return None
    r7 = probe.quant_object("r7_routed_experts")
    if r7 is None:
        return None
    return DialectInfo(DIALECT_R7, "r7_shared", 1, probe.quant_codebook(), R7Declarations(r7))


# Every problem of an R7 bit map is a warning: no loader reads these files (the R7 loader takes each K from the
# trellis shape), so a broken map leaves its layer without a declared K, not unloadable.
UNREAD_NOTE = " (the R7 loader does not read it; its layer has no declared K)"

_MANIFEST_LAYER = re.compile(r"layer-([0-9]+)")  # a file name: zero-padded, ASCII


def k_declared(r7: dict[str, Any], read_json: Callable[[str], Any], files: dict[str, int]) -> Declared:
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
                                        "found" + UNREAD_NOTE))
            continue
        try:
            data = read_json(name)
        except (CheckFailed, SourceUnavailable) as e:
            out.findings.append(warning("bitmap.unreadable", Location(file=name), str(e).split(": ", 1)[-1]
                                        + UNREAD_NOTE))
            continue
        layer: Any = data.get("layer", m.group(1)) if isinstance(data, dict) else m.group(1)
        if isinstance(layer, str) and layer.isascii() and layer.isdecimal():
            layer = int(layer)  # a value (the file's own "layer"), not a key looked up: padding allowed
        if not is_int(layer) or layer < 0:  # the file's own "layer" wins over its name, so it must be a number
            out.findings.append(warning("bitmap.unreadable", Location(file=name), "\"layer\" is not a layer "
                                        "number" + UNREAD_NOTE, "a decimal layer index", repr(layer)[:60]))
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
                expert = parse_id(key)
                for proj, k in value.items():
                    if expert is not None:
                        result[(expert, proj)] = k
            elif "." in str(key):  # {"E.proj": K}
                e, proj = str(key).split(".", 1)
                expert = parse_id(e)
                if expert is not None:
                    result[(expert, proj)] = value
    return result
