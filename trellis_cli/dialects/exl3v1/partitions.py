"""How two planners cut an exl3-v1 layer into TP rank extents, for `validate --tp N`: they differ, so a tool
that predicts a rank's slots must say which one it follows.

- b12x's `Exl3Manifest.partition_extents(world_size)` (b12x repository after 1.5.1, commit e14d41c4; not in
  the 1.5.1 wheel): barrier segments first, each extra rank to the segment with the widest ranks, units of
  `extent_alignment_slots` dealt out with the first ranks of a segment taking the remainder. Widths may
  differ between ranks; the same extents for every layer.
- the vLLM fork's `plan_exl3_extent` (local-inference-lab/vllm@174fe4d4, quantization/utils/exl3.py): TP
  2..24, exactly one barrier at the halfway slot, ceil(TP/2) ranks on the first half, and ownership rotated by
  one rank per MoE layer (two at TP 10).

On a layout the fork takes they agree on the layers its rotation brings back to the start (the first MoE layer,
then every TP-th, every TP/2-th at TP 10), and only where b12x also gives the first half ceil(TP/2) ranks
(at TP 10 over 16 + 16 units it gives 6 and 4). Torch-free arithmetic on the parsed Manifest.
"""

from __future__ import annotations

from typing import Any

from trellis_cli.dialects.exl3v1.schema import Manifest

B12X_PLANNER = "b12x partition_extents"
B12X_VERSION = "local-inference-lab/b12x@e14d41c4 moe/_shared/exl3_schema.py (after 1.5.1; absent from the 1.5.1 wheel)"
FORK_PLANNER = "vllm plan_exl3_extent"
FORK_VERSION = "local-inference-lab/vllm@174fe4d4 model_executor/layers/quantization/utils/exl3.py"
FORK_TP = range(2, 25)

Extent = tuple[int, int]  # (first slot, slot count)


class Refused(ValueError):
    """The planner's own refusal of this TP or layout."""


def partition_extents(m: Manifest, world_size: int) -> list[Extent]:
    """b12x's rank extents at `world_size` (rank r takes entry r); Refused as b12x refuses."""
    if world_size <= 0:
        raise Refused("world_size must be a positive integer")
    align = m.extent_alignment
    bounds = (0, *m.barriers, m.num_slots)
    if any(b % align for b in bounds):
        raise Refused(f"barriers {list(m.barriers)} must align to complete rank extent units of {align} slots")
    units = [(end - start) // align for start, end in zip(bounds, bounds[1:])]
    if not len(units) <= world_size <= sum(units):
        raise Refused(f"world_size {world_size} cannot cover {len(units)} barrier segment(s) with nonempty aligned "
                      f"extents ({sum(units)} units of {align} slots: {len(units)}..{sum(units)} ranks)")
    ranks = [1] * len(units)
    for _ in range(world_size - len(units)):
        open_ = [i for i, n in enumerate(units) if ranks[i] < n]
        widest = max(open_, key=lambda i: (-(-units[i] // ranks[i]), units[i], -i))
        ranks[widest] += 1
    extents: list[Extent] = []
    for start, n, r in zip(bounds, units, ranks):
        width, extra = divmod(n, r)
        for rank in range(r):
            size = (width + (rank < extra)) * align
            extents.append((start, size))
            start += size
    return extents


def plan_exl3_extent(m: Manifest, layer: int, tp: int, rank: int) -> Extent:
    """The fork's extent of `rank` at `tp` for MoE layer `layer`; Refused as the fork refuses (an empty extent
    included: b12x's reader refuses it next)."""
    if tp not in FORK_TP:
        raise Refused(f"TP {tp} is outside the 2..24 the planner takes")
    half = m.num_slots // 2
    align = m.extent_alignment
    if tuple(m.barriers) != (half,) or 2 * half != m.num_slots or half % align:
        raise Refused(f"the planner needs exactly one barrier, at slot {half}, between halves of whole "
                      f"{align}-slot blocks (barriers: {list(m.barriers)})")
    position = m.layer_indices.index(layer)
    owner = (rank - position * (2 if tp == 10 else 1)) % tp
    first_ranks = (tp + 1) // 2
    second = int(owner >= first_ranks)
    half_rank = owner - second * first_ranks
    blocks, extra = divmod(half // align, first_ranks if not second else tp - first_ranks)
    first_block = half_rank * blocks + min(half_rank, extra)
    count = blocks + int(half_rank < extra)
    if count == 0:
        raise Refused(f"rank {rank} gets an empty extent ({half // align} blocks of {align} slots per half for "
                      f"{first_ranks if not second else tp - first_ranks} ranks)")
    return half * second + align * first_block, align * count


def tp_partitions(m: Manifest, tp: int) -> list[dict[str, Any]]:
    """Both planners at `tp`: each one's extents (b12x's: one list for every layer; the fork's: per layer), or its
    refusal, named with its version."""
    b12x: dict[str, Any] = {"planner": B12X_PLANNER, "version": B12X_VERSION, "per_layer": False}
    try:
        shared = partition_extents(m, tp)
        b12x |= {"extents": [list(e) for e in shared], "refused": None}
    except Refused as e:
        shared = None
        b12x |= {"extents": None, "refused": str(e)}
    fork: dict[str, Any] = {"planner": FORK_PLANNER, "version": FORK_VERSION, "per_layer": True}
    try:
        layers = {li: [plan_exl3_extent(m, li, tp, r) for r in range(tp)] for li in m.layer_indices}
        fork |= {"layers": {str(li): [list(e) for e in ex] for li, ex in layers.items()}, "refused": None,
                 "same_as_b12x": [li for li, ex in layers.items() if shared is not None and ex == shared]}
    except Refused as e:
        fork |= {"layers": None, "refused": str(e), "same_as_b12x": []}
    return [b12x, fork]
