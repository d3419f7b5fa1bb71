"""What a repack will do before it does it: selected layers and ranks, tensor-parallel re-slicing, sizes.

Pure bookkeeping over the checkpoint model (no tensor data). The re-slicing rules live here because they
decide whether a `--tp` request is possible at all (docs/format.md "Tensor-parallel re-slicing"):

- a target rank covers the intermediate range [n*I/N, (n+1)*I/N); its boundaries must be multiples of 128,
  because each rank slice carries its own 128-blocked Hadamard on the intermediate side;
- inside one source rank any 128-aligned sub-range is exact (a split);
- a target rank that spans several source ranks (a merge) is exact only when the hidden-side vectors
  (gate suh, up suh, down svh) are byte-equal across those ranks; that is checked on the data, in pack.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.errors import UsageError
from trellis_cli.id_ranges import parse_range
from trellis_cli.formats.route_pack import layer_file_name, tier_trellis_shape

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


def parse_selection(text: str | list[int] | None, available: list[int], what: str) -> list[int]:
    """`--layers 3-5,40` (or the ids [3, 4, 5, 40], as options typed at the edge hold them) -> [3, 4, 5, 40];
    None selects everything; ids not available are refused."""
    if text is None or (isinstance(text, str) and text.strip() == ""):
        return sorted(available)
    have = set(available)
    if not isinstance(text, str):
        absent = sorted(i for i in set(text) if i not in have)
        if absent:
            raise UsageError(f"--{what}: {absent[:5]} not in the source (it has {_span(available)})")
        return sorted(set(text))
    chosen: set[int] = set()
    missing: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        try:
            first, last = parse_range(part)
        except ValueError as err:
            raise UsageError(f"--{what}: {err}") from None
        # Walk the available ids, never the range: 0-99999999999 must not be materialized.
        inside = {i for i in have if first <= i <= last}
        chosen |= inside
        if len(inside) < last - first + 1:
            missing += _first_missing(first, last, have, 5)
    if missing:
        raise UsageError(f"--{what}: {sorted(missing)[:5]} not in the source (it has {_span(available)})")
    return sorted(chosen)


def _first_missing(first: int, last: int, have: set[int], count: int) -> list[int]:
    """Up to `count` ids of [first, last] not in `have`; at most len(have) + count steps."""
    out: list[int] = []
    i = first
    while i <= last and len(out) < count:
        if i not in have:
            out.append(i)
        i += 1
    return out


def _span(ids: list[int]) -> str:
    return f"{min(ids)}-{max(ids)}" if ids else "none"


@dataclass(frozen=True)
class LayerRankJob:
    layer: int
    rank: int
    file: str  # output file name
    bytes: int  # expected data bytes of the output file (trellis + tables)


@dataclass
class RepackPlan:
    layers: list[int]
    ranks: list[int]
    source_tp: int
    target_tp: int
    shared_h: bool  # output hidden-side rotation rows collapsed to [1, H]
    jobs: list[LayerRankJob] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(j.bytes for j in self.jobs)


def layer_rank_bytes(checkpoint: Checkpoint, layer: int, target_tp: int, shared_h: bool) -> int:
    """Bytes of one output layer file's tensors (the header is a few KB more)."""
    moe = checkpoint.layers[layer]
    tiers = {k: len(ids) for k, ids in moe.partition().items()}
    hidden, intermediate = checkpoint.moe_sizes()
    return route_pack_layer_bytes(hidden, intermediate // target_tp, checkpoint.num_experts, len(moe.experts), tiers,
                                  shared_h)


def route_pack_layer_bytes(hidden: int, inter: int, num_experts: int | None, served: int, tiers: dict[int, int],
                           shared_h: bool) -> int:
    """Bytes of one output layer file's tensors from its geometry: `inter` features per rank, `served` experts
    present, `tiers` K -> expert count."""
    total = 0
    for k, count in tiers.items():
        total += 2 * _prod(tier_trellis_shape(count, hidden, inter, k))
    rows = 1 if shared_h else served
    total += 4 * (num_experts or served) + 4 * served + 8 * len(tiers)
    total += 2 * (served * 3 * inter + 3 * rows * hidden)
    return total


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def resolve_target_tp(requested: int | None, source_tp: int) -> int:
    """The TP degree to write: the source's when not given. 0 is refused, not taken as "not given"."""
    if requested is None:
        return source_tp
    if requested < 1:
        raise UsageError(f"--tp {requested}: must be at least 1 (leave --tp out to keep the source's TP "
                         f"{source_tp})")
    return requested


def make_plan(checkpoint: Checkpoint, *, layers: str | list[int] | None, ranks: str | list[int] | None, tp: int | None,
              shared_h: bool) -> RepackPlan:
    """Select layers and ranks, check the re-slicing is expressible, and list the output files."""
    if checkpoint.hidden is None or checkpoint.intermediate is None:
        raise UsageError("the source declares no hidden or intermediate size; nothing to repack")
    tp = resolve_target_tp(tp, checkpoint.tp)
    if tp != checkpoint.tp:
        rank_pieces(checkpoint.intermediate, checkpoint.tp, tp, 0)  # raises if inexpressible
    with_experts = [li for li, moe in checkpoint.layers.items() if moe.experts]  # declared-only layers hold nothing
    chosen_layers = parse_selection(layers, with_experts, "layers")
    chosen_ranks = parse_selection(ranks, list(range(tp)), "ranks")
    plan = RepackPlan(chosen_layers, chosen_ranks, checkpoint.tp, tp, shared_h)
    for layer in chosen_layers:
        size = layer_rank_bytes(checkpoint, layer, tp, shared_h)
        for rank in chosen_ranks:
            plan.jobs.append(LayerRankJob(layer, rank, layer_file_name(layer, rank), size))
    return plan
