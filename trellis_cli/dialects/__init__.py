"""Checkpoint dialects: one package per on-disk format, each behind the `Dialect` interface (interface.py),
found through one registry (registry.py). docs/architecture.md, "Dialects", says how to add one.

Entry point: `open_checkpoint(source)` (open.py): detection from metadata, then the dialect's opening into
the normalized model of checkpoint/. Imported lazily so that importing one dialect module stays cheap.
"""

from __future__ import annotations


def open_checkpoint(source, *, progress=None):  # noqa: D103 - thin re-export of open.open_checkpoint
    from trellis_cli.dialects.open import open_checkpoint as _open

    return _open(source, progress=progress)
