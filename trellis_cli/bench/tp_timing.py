"""`trellis bench --tp N` timing, run inside every rank on its own GPU (NCCL).

Per M, every rank draws the same inputs and routes and times three things, each as CUDA-graph replays cycling
cold weight copies as the single-GPU bench does (throughput.py): its fused kernel alone, the in-place
all-reduce of [M, hidden] alone, and the layer (kernel, then all-reduce of its output). A barrier starts each
phase on all ranks together. If NCCL refuses graph capture on any rank, every rank times the same calls
eagerly instead (reported per row as "graphs": false). Rank 0 gathers every rank's medians; the report has
the kernel's min and max over ranks (the slowest rank is what a user waits for), the all-reduce and the layer
as the slowest rank saw them, and each rank's numbers.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence, TypedDict

import torch
import torch.distributed as dist

from trellis_cli.bench.throughput import TimingJson, WeightPool, capture_graph, copies_needed, time_graphs, touched
from trellis_cli.bench.tp_check import shared_inputs

OUT_DTYPE = torch.float32  # what the fused kernel writes and the all-reduce sums


class _Eager:
    """A call timed like a graph replay, for when NCCL cannot be captured."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.replay = fn


def _graphs_everywhere(fns: Sequence[Callable[[], object]], device: torch.device) -> tuple[list, bool]:
    """Capture every call on every rank, or on none: ranks agree before any replay (collectives must pair)."""
    try:
        graphs, ok = [capture_graph(fn, device) for fn in fns], 1
    except RuntimeError:
        graphs, ok = [], 0
    flag = torch.tensor([ok], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag.item()) == 1:
        return graphs, True
    return [_Eager(fn) for fn in fns], False


def _phase(fns: Sequence[Callable[[], object]], replays: int, device: torch.device) -> tuple[TimingJson, bool]:
    timers, graphed = _graphs_everywhere(fns, device)
    dist.barrier()
    torch.cuda.synchronize(device)
    return time_graphs(timers, replays, device).as_dict(), graphed


class RankTimes(TypedDict):
    """One rank's timings of one M (gathered to rank 0, kept in the row's `per_rank`)."""

    m: int
    copies: int
    experts: int
    bytes: int
    kernel: TimingJson
    all_reduce: TimingJson
    layer: TimingJson
    graphs: bool  # the all-reduce and the layer ran as CUDA graphs (else eagerly, on every rank)


class TpTimingRow(TypedDict):
    """One M of a `--tp` timing's `rows`: the slowest rank's times, every rank's beside them."""

    m: int
    experts: int
    all_reduce_bytes: int
    kernel: dict[str, Any]  # min_us, max_us, per_rank_us
    all_reduce: dict[str, Any]  # median_us (the slowest rank's), per_rank_us
    layer: dict[str, Any]  # the same
    layer_over_max_kernel: float
    graphs: bool
    per_rank: list[RankTimes]


def rank_times(pool: WeightPool, m: int, *, cold: bool, replays: int, seed: int, l2_bytes: int) -> RankTimes:
    """This rank's kernel, all-reduce and layer timings for one M (collective: every rank calls it)."""
    base = pool.runners[0]
    pack, device = base.pack, base.device
    x, ids, weights = shared_inputs(pack, m, seed, device)
    work = touched(pack, ids)
    runners = pool.take(copies_needed(work["bytes"], l2_bytes, cold))
    outs = [torch.empty((m, pack.hidden), dtype=OUT_DTYPE, device=device) for _ in runners]
    reduce_only = torch.zeros((m, pack.hidden), dtype=OUT_DTYPE, device=device)  # zeros stay finite when summed

    def layer(runner, out) -> None:
        runner.forward(x, ids, weights, out=out)
        dist.all_reduce(out)

    kernel_t, _ = _phase([partial(r.forward, x, ids, weights, out=o) for r, o in zip(runners, outs)],
                         replays, device)
    reduce_t, reduce_graphed = _phase([partial(dist.all_reduce, reduce_only)], replays, device)
    layer_t, layer_graphed = _phase([partial(layer, r, o) for r, o in zip(runners, outs)], replays, device)
    return {"m": m, "copies": len(runners), "experts": work["experts"], "bytes": work["bytes"],
            "kernel": kernel_t, "all_reduce": reduce_t, "layer": layer_t,
            "graphs": reduce_graphed and layer_graphed}


def rank_timing(pack, library, ms: list[int], *, cold: bool, replays: int, seed: int,
                log: Callable[[str], None] = lambda s: None) -> list[RankTimes]:
    pool = WeightPool(pack, library)
    device = pool.runners[0].device
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))
    rows: list[RankTimes] = []
    for m in ms:
        log(f"throughput: TP{dist.get_world_size()} M={m} ({'cold' if cold else 'warm'})")
        rows.append(rank_times(pool, m, cold=cold, replays=replays, seed=seed + m, l2_bytes=l2_bytes))
        torch.cuda.empty_cache()
    return rows


def combine_ranks(per_rank: list[list[RankTimes]], hidden: int) -> list[TpTimingRow]:
    """One report row per M from every rank's rows (rank order)."""
    rows: list[TpTimingRow] = []
    for index, first in enumerate(per_rank[0]):
        ranks = [rows_of_rank[index] for rows_of_rank in per_rank]
        kernel = [r["kernel"]["median_us"] for r in ranks]
        reduce = [r["all_reduce"]["median_us"] for r in ranks]
        layer = [r["layer"]["median_us"] for r in ranks]
        rows.append({
            "m": first["m"],
            "experts": first["experts"],
            "all_reduce_bytes": first["m"] * hidden * OUT_DTYPE.itemsize,
            "kernel": {"min_us": min(kernel), "max_us": max(kernel), "per_rank_us": kernel},
            "all_reduce": {"median_us": max(reduce), "per_rank_us": reduce},
            "layer": {"median_us": max(layer), "per_rank_us": layer},
            "layer_over_max_kernel": max(layer) / max(kernel),
            "graphs": all(r["graphs"] for r in ranks),
            "per_rank": ranks,
        })
    return rows
