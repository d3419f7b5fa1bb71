"""Tensor-parallel re-slicing: which source-rank pieces make each target rank.

Pure bookkeeping (no tensor data). The rules decide whether a `--tp` request is possible at all, for every
packer, driver and bench mode that re-slices (docs/format.md "Tensor-parallel re-slicing"):

- a target rank covers the intermediate range [n*I/N, (n+1)*I/N); its boundaries must be multiples of 128,
  because each rank slice carries its own 128-blocked Hadamard on the intermediate side;
- inside one source rank any 128-aligned sub-range is exact (a split);
- a target rank that spans several source ranks (a merge) is exact only when the hidden-side vectors
  (gate suh, up suh, down svh) are byte-equal across those ranks; that is checked on the data, in pack.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.errors import UsageError

HADAMARD_BLOCK = 128


@dataclass(frozen=True)
class Piece:
    """Intermediate features [lo, hi) of one source rank (local coordinates) that a target rank takes."""

    source_rank: int
    lo: int
    hi: int


def rank_pieces(intermediate: int, source_tp: int, target_tp: int, rank: int) -> list[Piece]:
    """The source-rank pieces that make target rank `rank` under `target_tp`; raises UsageError if inexact."""
    if target_tp < 1 or intermediate % target_tp:
        raise UsageError(f"--tp {target_tp}: intermediate size {intermediate} does not split into {target_tp} ranks")
    width = intermediate // target_tp
    if width % HADAMARD_BLOCK:
        raise UsageError(
            f"--tp {target_tp}: {width} intermediate features per rank is not a multiple of {HADAMARD_BLOCK}; "
            f"each rank slice needs whole 128-wide Hadamard blocks"
        )
    source_width = intermediate // source_tp
    lo, hi = rank * width, (rank + 1) * width
    pieces = []
    for r in range(lo // source_width, (hi - 1) // source_width + 1):
        start = max(lo, r * source_width)
        stop = min(hi, (r + 1) * source_width)
        pieces.append(Piece(r, start - r * source_width, stop - r * source_width))
    return pieces


def is_identity(pieces: list[Piece], source_width: int) -> bool:
    return len(pieces) == 1 and pieces[0].lo == 0 and pieces[0].hi == source_width


def resolve_target_tp(requested: int | None, source_tp: int) -> int:
    """The TP degree to write: the source's when not given. 0 is refused, not taken as "not given"."""
    if requested is None:
        return source_tp
    if requested < 1:
        raise UsageError(f"--tp {requested}: must be at least 1 (leave --tp out to keep the source's TP "
                         f"{source_tp})")
    return requested
