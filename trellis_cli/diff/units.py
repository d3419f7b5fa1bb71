"""One side of a diff as logical units, the same for every dialect.

What a unit is, and the per-linear shards' answer, is dialects/units.py; each dialect answers for its own bytes
(`Dialect.layer_units` and its `bulk_units`, `other_units`, `compared_layers`, `stored_tp`,
`layer_file_tensors`), so nothing here
asks which dialect a side is.
"""

from __future__ import annotations

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.dialects.units import CODES, HIDDEN, INTERMEDIATE, OTHER, BulkUnits, Key, Span, Unit

__all__ = ["CODES", "HIDDEN", "INTERMEDIATE", "OTHER", "BulkUnits", "Key", "Span", "Unit", "bulk_units",
           "layer_file_tensors", "layer_units", "moe_layers", "native_tp", "other_units", "read_tp"]


def native_tp(ck: Checkpoint) -> int | None:
    """The TP a side stores; None where a rank is cut when read (an exl3-v1 slot layout, at any TP it allows)."""
    return dialect_of(ck).stored_tp(ck)


def read_tp(ck: Checkpoint) -> int:
    """The TP two sides without a stored TP are compared at."""
    return dialect_of(ck).read_tp(ck)


def layer_units(ck: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
    """Every unit of MoE layer `layer` at `tp` ranks (empty when the side has no such layer)."""
    if layer not in moe_layers(ck):
        return {}
    return dialect_of(ck).layer_units(ck, layer, tp)


def bulk_units(ck: Checkpoint, layer: int, tp: int) -> BulkUnits | None:
    """`layer_units` of a layer both sides hold, in bulk (no record per unit); None where only the records say."""
    return dialect_of(ck).bulk_units(ck, layer, tp)


def moe_layers(ck: Checkpoint) -> list[int]:
    return dialect_of(ck).compared_layers(ck)


def layer_file_tensors(ck: Checkpoint, layer: int) -> dict[Key, Unit] | None:
    """A layer file's tensors by name, where the side keeps each layer whole in one file; None otherwise."""
    return dialect_of(ck).layer_file_tensors(ck, layer)


def other_units(ck: Checkpoint) -> dict[Key, Unit]:
    """Every tensor outside the MoE expert layout, by name (the first file holding a name wins)."""
    return dialect_of(ck).other_units(ck)
