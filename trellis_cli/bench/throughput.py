"""Throughput: CUDA-graph replay timings of the fused kernel and the two-pass baseline, per M.

Each M gets fresh random inputs and routes. One graph per weight copy is captured for the fused call
and for the two-pass call; replays cycle through the copies so that, with `cold`, enough other weight
bytes stream between two replays of the same copy that nothing is served from L2. Per M the report has
median/min/max µs over the replays, the compressed bytes of the experts actually touched, GB/s and the
share of the device-to-device copy bandwidth measured in the same run, TFLOP/s, and the effective decode
rate (weights of the touched experts per ms).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, TypedDict

import torch

from trellis_cli.bench.synthetic import clone_weights, random_activations, random_routes
from trellis_cli.kernel.abi import KernelLibrary
from trellis_cli.kernel.launch import FusedMoe
from trellis_cli.formats.layer_pack import LayerPack, split_descriptor

WARMUP_REPLAYS = 10
TOP_K = 8
MAX_COPIES = 16
L2_PASSES = 3  # bytes streamed between two replays of one copy, in L2 sizes


class TimingJson(TypedDict):
    """A Timing as the JSON rows carry it."""

    median_us: float
    min_us: float
    max_us: float
    replays: int


class Touched(TypedDict):
    """What one M's routes touch in a layer (`touched`)."""

    experts: int
    routes: int
    bytes: int
    weights: int
    flops: int


class PlanShape(TypedDict):
    """The launch plan a row was timed with."""

    m_tile: int
    k_split: int
    direct: bool
    family: str
    fc1_tail_split: int


class _RowFields(TypedDict):
    m: int
    copies: int  # weight copies cycled through so every replay reads from DRAM (cold)
    plan: PlanShape
    experts: int
    routes: int
    bytes: int
    weights: int
    flops: int
    fused: TimingJson
    two_pass: TimingJson
    fused_over_two_pass: float
    gbps: float
    pct_copy_bw: float
    tflops: float
    g_weights_per_ms: float


class ThroughputRow(_RowFields, total=False):
    """One M of the throughput document (`rows`), in its JSON key order."""

    compare: dict[str, Any]  # --compare: the peer's timing of the same M (peer_compare.PeerCompare.row)


class ThroughputReport(TypedDict):
    """The throughput document, less source, environment and the peer summary (bench/run.py adds them)."""

    cold: bool
    copy_gbps: float
    l2_bytes: int
    rows: list[ThroughputRow]


@dataclass
class Timing:
    median_us: float
    min_us: float
    max_us: float
    replays: int

    def as_dict(self) -> TimingJson:
        return {"median_us": self.median_us, "min_us": self.min_us, "max_us": self.max_us, "replays": self.replays}


def copy_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1000 / reps
    del src, dst
    return 2 * nbytes / seconds / 1e9


def touched(pack: LayerPack, topk_ids: torch.Tensor) -> Touched:
    """Experts served for these routes: their count, compressed bytes, weights and route FLOPs."""
    g2c = pack.global_to_combined.to(topk_ids.device)
    ids = topk_ids.long().reshape(-1)
    valid = (ids >= 0) & (ids < g2c.numel())
    combined = torch.where(valid, g2c[ids.clamp(0, g2c.numel() - 1)], -1)
    routes = int((combined >= 0).sum())
    experts = torch.unique(combined[combined >= 0]).tolist()
    desc = pack.descriptors.tolist()
    hidden, inter = pack.hidden, pack.intermediate
    tiles = (hidden // 16) * (inter // 16)
    per_expert_vectors = 3 * inter * 2 + sum(2 * hidden for t in (pack.gate_suh, pack.up_suh, pack.down_svh)
                                             if t.shape[0] != 1)
    code_bytes = sum(3 * tiles * 32 * pack.tier_k[split_descriptor(desc[c])[0]] for c in experts)
    return {
        "experts": len(experts),
        "routes": routes,
        "bytes": code_bytes + len(experts) * per_expert_vectors,
        "weights": len(experts) * 3 * hidden * inter,
        "flops": routes * 6 * hidden * inter,
    }


def copies_needed(touched_bytes: int, l2_bytes: int, cold: bool) -> int:
    if not cold:
        return 1
    return max(2, min(MAX_COPIES, math.ceil(L2_PASSES * l2_bytes / max(1, touched_bytes)) + 1))


class CapturedCall:
    """A CUDA graph with the call it was captured from.

    A graph keeps raw device addresses, not tensors: an output or input that is freed after the capture
    goes back to torch's allocator, which hands its memory to the next tensor while every replay still
    writes there. Holding the call holds its closure, and with it every tensor the graph touches, for as
    long as the graph lives. (Graphs whose outputs were freed this way overwrote other layers' workspaces
    and faulted on replay with an illegal address.)
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, call: Callable[[], object]) -> None:
        self.graph, self.call = graph, call

    def replay(self) -> None:
        self.graph.replay()


def capture_graph(fn: Callable[[], object], device: torch.device) -> CapturedCall:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fn()  # eager warm-up: allocates the workspace outside the capture
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    return CapturedCall(graph, fn)


def time_graphs(graphs: list[CapturedCall], replays: int, device: torch.device) -> Timing:
    return time_interleaved([graphs], replays, device)[0]


def interleaved_order(count: int, replays: int) -> list[tuple[int, int]]:
    """(set, replay) in launch order: round i replays every set once, starting at set i mod count."""
    return [((i + j) % count, i) for i in range(replays) for j in range(count)]


def time_interleaved(graph_sets: list[list[CapturedCall]], replays: int,
                     device: torch.device) -> list[Timing]:
    """Time several layers' graphs replay by replay in a rotating order, one Timing per set.

    Each round replays every set once, starting one set later than the round before, so clock and thermal
    drift, and whatever a replay leaves behind for the next, fall on all sets alike.
    """
    for i in range(WARMUP_REPLAYS):
        for graphs in graph_sets:
            graphs[i % len(graphs)].replay()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
              for _ in graph_sets]
    for which, i in interleaved_order(len(graph_sets), replays):
        start, end = events[which][i]
        start.record()
        graph_sets[which][i % len(graph_sets[which])].replay()
        end.record()
    torch.cuda.synchronize(device)
    timings = []
    for pairs in events:
        times = [start.elapsed_time(end) * 1000 for start, end in pairs]
        timings.append(Timing(statistics.median(times), min(times), max(times), replays))
    return timings


class WeightPool:
    """The layer plus as many fresh copies of it as the coldest M needs, each bound for launching."""

    def __init__(self, pack: LayerPack, library: KernelLibrary) -> None:
        self.library = library
        self.runners = [FusedMoe(pack, library)]

    def take(self, count: int) -> list[FusedMoe]:
        while len(self.runners) < count:
            self.runners.append(FusedMoe(clone_weights(self.runners[0].pack), self.library))
        return self.runners[:count]


def bench_m(pool: WeightPool, m: int, *, cold: bool, replays: int, seed: int, l2_bytes: int,
            copy_gbps: float, compare=None) -> ThroughputRow:
    base = pool.runners[0]
    pack, device = base.pack, base.device
    x = random_activations(m, pack.hidden, device=device, seed=seed)
    experts = int(pack.global_to_combined.shape[0])
    ids, weights = random_routes(m, experts, min(TOP_K, experts), device=device, seed=seed + 1)
    work = touched(pack, ids)
    runners = pool.take(copies_needed(work["bytes"], l2_bytes, cold))
    outs = [torch.empty((m, pack.hidden), dtype=torch.float32, device=device) for _ in runners]
    fused = [capture_graph(partial(r.forward, x, ids, weights, out=o), device) for r, o in zip(runners, outs)]
    two = [capture_graph(partial(r.two_pass, x, ids, weights, out=o), device) for r, o in zip(runners, outs)]
    fused_t = time_graphs(fused, replays, device)
    two_t = time_graphs(two, replays, device)
    plan = base.plan(m, int(ids.shape[1]))
    seconds = fused_t.median_us / 1e6
    gbps = work["bytes"] / seconds / 1e9
    del fused, two
    row: ThroughputRow = {
        "m": m,
        "copies": len(runners),
        "plan": {"m_tile": plan.m_tile, "k_split": plan.k_split, "direct": plan.direct, "family": plan.family,
                 "fc1_tail_split": plan.fc1_tail_split},
        "experts": work["experts"], "routes": work["routes"], "bytes": work["bytes"], "weights": work["weights"],
        "flops": work["flops"],
        "fused": fused_t.as_dict(),
        "two_pass": two_t.as_dict(),
        "fused_over_two_pass": fused_t.median_us / two_t.median_us,
        "gbps": gbps,
        "pct_copy_bw": 100.0 * gbps / copy_gbps,
        "tflops": work["flops"] / seconds / 1e12,
        "g_weights_per_ms": work["weights"] / (seconds * 1e3) / 1e9,
    }
    if compare is not None:
        row["compare"] = compare.row(runners, x, ids, weights, fused_t.median_us, replays)
    return row


def device_facts(device: torch.device, log: Callable[[str], None]) -> tuple[int, float]:
    """The L2 size the cold copies are sized against, and the copy bandwidth the GB/s are compared with."""
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 50 << 20))
    copy_gbps = copy_bandwidth_gbps(device)
    log(f"copy bandwidth {copy_gbps:.0f} GB/s (read + write), L2 {l2_bytes >> 20} MiB")
    return l2_bytes, copy_gbps


def run_throughput(pack: LayerPack, library: KernelLibrary, ms: list[int], *, cold: bool = True,
                   replays: int = 100, seed: int = 1234, log: Callable[[str], None] = lambda s: None,
                   compare=None) -> ThroughputReport:
    """`compare`, when given, is a peer_compare.PeerCompare: each row gains the peer's timing of the same
    M (same inputs, routes and weight copies)."""
    pool = WeightPool(pack, library)
    device = pool.runners[0].device
    l2_bytes, copy_gbps = device_facts(device, log)
    rows: list[ThroughputRow] = []
    for m in ms:
        plan = pool.runners[0].plan(m, min(TOP_K, int(pack.global_to_combined.shape[0])))
        log(f"throughput: M={m} ({'cold' if cold else 'warm'}), plan: {plan.describe()}")
        rows.append(bench_m(pool, m, cold=cold, replays=replays, seed=seed + m, l2_bytes=l2_bytes,
                            copy_gbps=copy_gbps, compare=compare))
        torch.cuda.empty_cache()
    return {"cold": cold, "copy_gbps": copy_gbps, "l2_bytes": l2_bytes, "rows": rows}
