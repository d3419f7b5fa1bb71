"""The mixed-model gap: a mixed-K synthetic layer timed beside uniform layers of each of its K, same shape.

For partition n_t over tiers of K_t (e.g. 192 K3 / 64 K4 of 256 experts) the uniform layers put every expert
on one tier. The interpolated time is sum_t n_t * t_uniform(K_t) / sum_t n_t: the straight line between the
uniform times, read at the mixed layer's bitrate (3.25 bpw for 192/64 lies 0.25 of the way from K3 to K4).
The gap is how much slower the mixed layer runs than that line, in percent.

All layers see the same inputs and routes per M, and their CUDA graphs are timed replay by replay in a
rotating order (throughput.time_interleaved), so clock and thermal drift fall on all of them alike. With few
tokens the experts a route set touches need not split like the partition (M=1 touches 8 of 256), so each
row also carries the interpolation weighted by the tier split of the experts actually touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, TypedDict

import torch

from trellis_cli.bench.synthetic import (Preset, get_preset, parse_partition, random_activations, random_routes,
                                         synthetic_pack)
from trellis_cli.bench.throughput import (TOP_K, WeightPool, capture_graph, copies_needed, device_facts,
                                          TimingJson, time_interleaved, touched)
from trellis_cli.errors import UsageError
from trellis_cli.formats.layer_pack import LayerPack, split_descriptor


@dataclass(frozen=True)
class GapPlan:
    """What a --mixed-gap run builds: the preset's shape at the mixed partition and at each uniform one."""

    preset: Preset
    partition: tuple[int, ...]

    @property
    def kept(self) -> list[tuple[int, int]]:
        """(tier index, K) of the tiers holding experts, ascending K (the mixed pack's tier order)."""
        return [(t, k) for t, (n, k) in enumerate(zip(self.partition, self.preset.tier_k)) if n > 0]

    @property
    def label(self) -> str:
        return "/".join(str(n) for n in self.partition)

    @property
    def description(self) -> str:
        return f"synthetic {self.preset.name} partition {self.label}"

    @property
    def weights(self) -> list[float]:
        return interpolation_weights([self.partition[t] for t, _ in self.kept])

    @property
    def bpw(self) -> float:
        """Trellis bits per weight of the mixed layer (the point on the line between the uniform K)."""
        return sum(self.partition[t] * k for t, k in self.kept) / sum(self.partition)

    def uniform_partition(self, tier: int) -> tuple[int, ...]:
        return tuple(self.preset.experts if t == tier else 0 for t in range(len(self.partition)))


class UniformTiming(TypedDict):
    """One uniform layer (a kept tier's K for every expert) at one M."""

    k: int
    experts: int  # experts the routes touch
    bytes: int
    copies: int
    fused: TimingJson


class MixedTiming(TypedDict):
    """The mixed layer at one M."""

    experts: int
    bytes: int
    copies: int
    tier_experts: list[int]  # touched experts per tier
    fused: TimingJson


class GapRow(TypedDict):
    """One M of the --mixed-gap document (`rows`), in its JSON key order."""

    m: int
    uniform: list[UniformTiming]
    mixed: MixedTiming
    interpolated_us: float
    gap_pct: float
    touched_interpolated_us: float
    touched_gap_pct: float


class GapTier(TypedDict):
    k: int
    experts: int
    weight: float  # its share of the experts: its weight on the bitrate line


class GapReport(TypedDict):
    """The --mixed-gap document, less source and environment (bench/run.py adds them)."""

    mode: str
    preset: str
    partition: str
    tiers: list[GapTier]
    mixed_bpw: float
    cold: bool
    replays: int
    copy_gbps: float
    l2_bytes: int
    rows: list[GapRow]


def plan_mixed_gap(source: str | None, synthetic: str | None, partition: str | None) -> GapPlan:
    """Check the --mixed-gap arguments (no GPU needed; the options it does not combine with are refused by
    bench/request.py) and return what to build."""
    if source or not synthetic:
        raise UsageError("--mixed-gap times synthetic layers: give --synthetic NAME (and no SOURCE)")
    preset = get_preset(synthetic)
    parts = parse_partition(partition, len(preset.tier_k)) if partition else preset.partition
    if sum(parts) != preset.experts:
        raise UsageError(f"--partition {'/'.join(map(str, parts))}: must add up to {preset.experts} experts")
    if sum(1 for n in parts if n > 0) < 2:
        raise UsageError(f"--partition {'/'.join(map(str, parts))}: --mixed-gap needs experts in at least two "
                         "tiers (a uniform layer has no gap to measure)")
    return GapPlan(preset, parts)


def interpolation_weights(counts: list[int] | tuple[int, ...]) -> list[float]:
    """Each tier's share of the experts: the weights of the uniform times on the bitrate line."""
    total = sum(counts)
    if total <= 0:
        raise ValueError(f"tier counts {counts}: no experts to weight")
    return [n / total for n in counts]


def interpolate(uniform_us: list[float], weights: list[float]) -> float:
    return sum(t * w for t, w in zip(uniform_us, weights, strict=True))


def gap_pct(mixed_us: float, interpolated_us: float) -> float:
    """How much slower the mixed layer is than the interpolation, in percent (negative: faster)."""
    return 100.0 * (mixed_us - interpolated_us) / interpolated_us


def gap_row(m: int, uniform: list[UniformTiming], mixed: MixedTiming, weights: list[float]) -> GapRow:
    """One M of the report. `uniform`: per kept tier {"k", "experts", "bytes", "fused"}; `mixed`: the same
    plus "tier_experts" (touched experts per tier); "fused" is a Timing.as_dict()."""
    uniform_us = [u["fused"]["median_us"] for u in uniform]
    mixed_us = mixed["fused"]["median_us"]
    interpolated = interpolate(uniform_us, weights)
    touched_interpolated = interpolate(uniform_us, interpolation_weights(mixed["tier_experts"]))
    return {
        "m": m,
        "uniform": uniform,
        "mixed": mixed,
        "interpolated_us": interpolated,
        "gap_pct": gap_pct(mixed_us, interpolated),
        "touched_interpolated_us": touched_interpolated,
        "touched_gap_pct": gap_pct(mixed_us, touched_interpolated),
    }


def gap_layers(plan: GapPlan, *, device, seed: int) -> list[tuple[str, LayerPack]]:
    """(label, LayerPack): one uniform layer per kept tier, ascending K, then the mixed layer (seeded as a
    plain `--synthetic` run of that partition is)."""
    layers = [(f"K{k}", synthetic_pack(plan.preset, plan.uniform_partition(t), device=device, seed=seed + 1 + t))
              for t, k in plan.kept]
    layers.append(("mixed", synthetic_pack(plan.preset, plan.partition, device=device, seed=seed)))
    return layers


def tier_split(pack: LayerPack, topk_ids: torch.Tensor) -> list[int]:
    """Experts these routes touch in each tier of `pack` (unmapped ids touch nothing)."""
    g2c = pack.global_to_combined.to(topk_ids.device)
    ids = topk_ids.long().reshape(-1)
    ids = ids[(ids >= 0) & (ids < g2c.numel())]
    combined = torch.unique(g2c[ids])
    combined = combined[combined >= 0].long()
    tiers = split_descriptor(pack.descriptors.to(combined.device)[combined])[0]
    assert isinstance(tiers, torch.Tensor)  # a tensor of descriptors in, a tensor of tiers out
    return torch.bincount(tiers, minlength=len(pack.tier_k)).tolist()


def measure_gap_m(pools: list[WeightPool], plan: GapPlan, m: int, *, cold: bool, replays: int, seed: int,
                  l2_bytes: int) -> GapRow:
    """Time every layer of `pools` (uniform ones, then mixed) on one set of inputs and routes."""
    mixed_pack = pools[-1].runners[0].pack
    device = pools[-1].runners[0].device
    x = random_activations(m, mixed_pack.hidden, device=device, seed=seed)
    experts = int(mixed_pack.global_to_combined.shape[0])
    ids, weights = random_routes(m, experts, min(TOP_K, experts), device=device, seed=seed + 1)
    works: list[tuple[int, int, int]] = []  # (touched experts, bytes, copies) per layer
    graph_sets = []
    for pool in pools:
        work = touched(pool.runners[0].pack, ids)
        runners = pool.take(copies_needed(work["bytes"], l2_bytes, cold))
        outs = [torch.empty((m, mixed_pack.hidden), dtype=torch.float32, device=device) for _ in runners]
        graph_sets.append([capture_graph(partial(r.forward, x, ids, weights, out=o), device)
                           for r, o in zip(runners, outs)])
        works.append((work["experts"], work["bytes"], len(runners)))
    timings = time_interleaved(graph_sets, replays, device)
    uniform: list[UniformTiming] = [
        {"k": k, "experts": experts, "bytes": nbytes, "copies": copies, "fused": t.as_dict()}
        for (_, k), (experts, nbytes, copies), t in zip(plan.kept, works[:-1], timings[:-1])]
    experts, nbytes, copies = works[-1]
    mixed: MixedTiming = {"experts": experts, "bytes": nbytes, "copies": copies,
                          "tier_experts": tier_split(mixed_pack, ids), "fused": timings[-1].as_dict()}
    return gap_row(m, uniform, mixed, plan.weights)


def run_mixed_gap(plan: GapPlan, library, ms: list[int], *, cold: bool = True, replays: int = 100, seed: int = 0,
                  log: Callable[[str], None] = lambda s: None) -> GapReport:
    layers = gap_layers(plan, device="cuda", seed=seed)
    pools = [WeightPool(pack, library) for _, pack in layers]
    l2_bytes, copy_gbps = device_facts(pools[-1].runners[0].device, log)
    rows: list[GapRow] = []
    for m in ms:
        log(f"mixed gap: M={m} ({'cold' if cold else 'warm'}), {', '.join(label for label, _ in layers)} interleaved")
        rows.append(measure_gap_m(pools, plan, m, cold=cold, replays=replays, seed=seed + 1234 + m,
                                  l2_bytes=l2_bytes))
        torch.cuda.empty_cache()
    return gap_report(plan, rows, cold=cold, replays=replays, copy_gbps=copy_gbps, l2_bytes=l2_bytes)


def gap_report(plan: GapPlan, rows: list[GapRow], *, cold: bool, replays: int, copy_gbps: float,
               l2_bytes: int) -> GapReport:
    """The --mixed-gap document (less source and environment, which the CLI adds)."""
    return {
        "mode": "mixed-gap",
        "preset": plan.preset.name,
        "partition": plan.label,
        "tiers": [{"k": k, "experts": plan.partition[t], "weight": w} for (t, k), w in zip(plan.kept, plan.weights)],
        "mixed_bpw": plan.bpw,
        "cold": cold,
        "replays": replays,
        "copy_gbps": copy_gbps,
        "l2_bytes": l2_bytes,
        "rows": rows,
    }
