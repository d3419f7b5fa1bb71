"""Checkpoint dialects: one package per on-disk format, each behind the `Dialect` interface (interface.py),
found through one registry (registry.py). docs/architecture.md, "Dialects", says how to add one.

Entry point: `open_checkpoint(source)` (open.py): detection from metadata, then the dialect's opening into
the normalized model of checkpoint/. Imported lazily so that importing one dialect module stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from trellis_cli.formats.layer_pack import LayerPack


def open_checkpoint(source, *, progress=None):  # noqa: D103 - thin re-export of open.open_checkpoint
    from trellis_cli.dialects.open import open_checkpoint as _open

    return _open(source, progress=progress)


def read_layer_pack(path: str | Path, layer: int, rank: int, device: str = "cpu") -> LayerPack:
    """One (layer, rank) of a route pack's directory, or the layer file `path` itself, as stored (the library's
    `trellis_cli.read_layer_pack`)."""
    from trellis_cli.dialects.routepack.layer_file import read_layer_pack as _read

    return _read(path, layer, rank, device=device)
