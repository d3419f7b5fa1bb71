"""Free space checked before a long write: a command that needs more than the filesystem of OUT has refuses
at once, by name, instead of filling the disk and failing on ENOSPC with a partial output."""

from __future__ import annotations

import shutil
from pathlib import Path

from trellis_cli.errors import CheckFailed

HEADROOM_BYTES = 64 << 20  # headers, JSON files, manifests, temporary names


def free_bytes(out: Path) -> int:
    """Free bytes on the filesystem that will hold `out` (its nearest existing ancestor's)."""
    probe = Path(out).absolute().parent
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def space_refusal(out: Path, free: int, needed: int, what: str) -> str | None:
    """Why `needed` more bytes (plus the headroom) do not fit in `free` bytes for `what`, or None when they do."""
    if free >= needed + HEADROOM_BYTES:
        return None
    return (f"{out}: {free / 1e9:.2f} GB free on its filesystem, {what} needs "
            f"{(needed + HEADROOM_BYTES) / 1e9:.2f} GB")


def require_free_space(out: Path, needed: int, what: str) -> None:
    """CheckFailed (exit 1) naming OUT, what is free and what `what` needs, when `needed` plus the headroom
    does not fit."""
    refusal = space_refusal(out, free_bytes(out), needed, what)
    if refusal:
        raise CheckFailed(f"{refusal}; nothing was written")
