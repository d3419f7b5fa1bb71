"""The peer timed on our layer, per M, beside our fused kernel (`trellis bench --compare exllamav3`).

For each M the peer gets the inputs and routes our kernel was timed with, and the same weight copies
(cold L2 works the same way: replays cycle through the copies). One peer call per K tier, each with that
tier's experts; the tier medians are summed. A tier whose calls can be captured is timed as CUDA-graph
replays like ours; the peer's large-batch path reads expert counts back to the host (a synchronisation a
graph cannot hold), so those calls are timed eagerly between CUDA events, host work included, which is how
they run in the peer. Before any timing counts, the peer's output (summed over tiers) is held to the float64
reference of --smoke: a tensor-mapping mistake cannot turn into a timing.
"""

from __future__ import annotations

import operator
import statistics
from functools import partial, reduce
from typing import Any, Callable, Mapping, Sequence

import torch

from trellis_cli.bench.peer_exllamav3 import PEER, PeerApi, PeerTier, peer_layer, split_routes
from trellis_cli.bench.smoke import rel_l2
from trellis_cli.bench.throughput import WARMUP_REPLAYS, Timing, capture_graph, time_graphs
from trellis_cli.kernel.launch import FusedMoe
from trellis_cli.reference import layer_pack_forward

PEER_LIMIT = 1e-2  # rel L2 to the float64 reference (fp16 intermediates); a wrong mapping is ~1


class PeerCompare:
    """Times the peer on the runners' packs; one set of peer modules per weight copy, built on first use."""

    def __init__(self, api: PeerApi, top_k: int, log: Callable[[str], None] = lambda s: None) -> None:
        self.api, self.top_k, self.log = api, top_k, log
        self.layers: dict[int, tuple[FusedMoe, list[PeerTier]]] = {}

    def tiers_for(self, runner: FusedMoe) -> list[PeerTier]:
        if id(runner) not in self.layers:  # the runner is kept with it, so its id stays its own
            self.layers[id(runner)] = (runner, peer_layer(self.api, runner.pack, self.top_k))
        return self.layers[id(runner)][1]

    def row(self, runners: list[FusedMoe], x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            ours_us: float, replays: int) -> dict[str, Any]:
        """The `compare` entry of one M's throughput row."""
        m = int(x.shape[0])
        device = runners[0].device
        xh = x.to(torch.float16).contiguous()  # the peer's activation dtype
        routes = split_routes(runners[0].pack, ids, weights)
        layers = [self.tiers_for(r) for r in runners]
        peer_rel, ours_rel = self._agreement(runners[0], layers[0], x, xh, ids, weights, routes)
        entry = {"peer": PEER, "version": self.api.version, "rel_l2": peer_rel, "ours_rel_l2": ours_rel,
                 "limit": PEER_LIMIT, "agrees": peer_rel <= PEER_LIMIT}
        if not entry["agrees"]:
            return {**entry, "us": None, "ratio": None, "per_tier_us": [], "per_tier": [], "graphs": None}
        per_tier: list[dict[str, Any]] = []
        for t, (tier_ids, tier_weights) in enumerate(routes):
            self.log(f"compare: {PEER} M={m} tier {t} (K{layers[0][t].k}, {layers[0][t].experts} experts)")
            calls = [partial(layer[t].forward, xh, tier_ids, tier_weights) for layer in layers]
            timing, graphs = self._time_tier(calls, m, layers[0][t], replays, device)
            per_tier.append({"tier": t, "k": layers[0][t].k, "experts": layers[0][t].experts,
                             "routes": int((tier_ids < layers[0][t].experts).sum()), **timing.as_dict(),
                             "graphs": graphs})
        us = sum(p["median_us"] for p in per_tier)
        return {**entry, "us": us, "ratio": us / ours_us, "per_tier_us": [p["median_us"] for p in per_tier],
                "per_tier": per_tier, "graphs": all(p["graphs"] for p in per_tier)}

    def _agreement(self, runner: FusedMoe, tiers: list[PeerTier], x: torch.Tensor, xh: torch.Tensor,
                   ids: torch.Tensor, weights: torch.Tensor, routes: list[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[float, float]:
        ref = layer_pack_forward(runner.pack, x, ids, weights, dtype=torch.float64)
        peer = reduce(operator.add, [tier.forward(xh, *route).double() for tier, route in zip(tiers, routes)])
        ours = runner.forward(x, ids, weights)
        values = rel_l2(peer, ref), rel_l2(ours, ref)
        del ref, peer, ours
        return values

    def _time_tier(self, calls: Sequence[Callable[[], object]], m: int, tier: PeerTier, replays: int,
                   device: torch.device) -> tuple[Timing, bool]:
        if capturable(self.api, tier, m, self.top_k):
            try:
                graphs = [capture_graph(call, device) for call in calls]
            except RuntimeError as err:  # a path that syncs with the host after all: time it eagerly
                torch.cuda.synchronize(device)
                self.log(f"compare: M={m}: {PEER} call not capturable ({str(err).splitlines()[0][:120]}); "
                         "timing eager calls")
            else:
                return time_graphs(graphs, replays, device), True
        return time_eager(calls, replays, device), False


def capturable(api: PeerApi, tier: PeerTier, m: int, top_k: int) -> bool:
    """Whether the peer's call at this M runs without a host synchronisation: its fused decode kernels
    (M <= its MAX_BSZN), or its fused MoE kernel when no expert can exceed that kernel's row capacity (it
    then skips reading the expert counts back)."""
    module = tier.module
    if m <= api.max_bszn and getattr(module, "bc", None) is not None:
        return True
    return getattr(module, "fused_mode_buffers", None) is not None and m * top_k <= int(module.fused_rows)


def time_eager(calls: Sequence[Callable[[], object]], replays: int, device: torch.device) -> Timing:
    """Median of eager calls, each between two CUDA events, cycling through `calls` (one per weight copy)."""
    for i in range(WARMUP_REPLAYS):
        calls[i % len(calls)]()
    times = []
    for i in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls[i % len(calls)]()
        end.record()
        end.synchronize()  # the next call's host work starts after this one's, as in the peer's own loop
        times.append(start.elapsed_time(end) * 1000)
    return Timing(statistics.median(times), min(times), max(times), replays)


def disagreements(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Cases where the peer's output did not match the reference (their timings were withheld)."""
    return [f"M={r['m']}: rel L2 {r['compare']['rel_l2']:.3g} > {r['compare']['limit']:g}"
            for r in rows if "compare" in r and not r["compare"]["agrees"]]
