"""What a repack into a route pack will do before it does it: the selected layers and ranks and each output
layer file with its size (the re-slicing rules are dialects/tp_reslice.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.errors import UsageError
from trellis_cli.selection import parse_selection
from trellis_cli.dialects.tp_reslice import rank_pieces, resolve_target_tp
from trellis_cli.dialects.routepack.layout import layer_file_name
from trellis_cli.formats.layer_pack import tier_trellis_shape


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
