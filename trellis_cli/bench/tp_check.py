"""`--smoke --tp N`, run inside every rank: the all-reduced layer output against the float64 reference.

Every rank draws the same random inputs and routes (one seed, on the CPU), computes its slice's partial output (the fused
kernel on a GPU; on CPU the float32 reference forward stands in for it) and sums the partials with an in-place
all-reduce. Two checks per M: each rank's partial against the float64 forward of its own slice (names the
worst rank, so a bad slice is located), and the all-reduced output against the float64 forward of the whole
layer (tp_source.whole_layer_reference; for a layer that is its rank slices, the all-reduced float64 slice
forwards). Limits: 1e-3 relative L2 for the kernel (as the single-GPU smoke), 1e-5 for the float32 stand-in.
Token counts: the single-GPU smoke's on a GPU, 1, 7 and 64 on CPU.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.distributed as dist

from trellis_cli.bench.smoke import REFERENCE_LIMIT, SMOKE_MS, Check, rel_l2
from trellis_cli.bench.synthetic import random_activations, random_routes
from trellis_cli.bench.tp_source import TpPlan, whole_layer_reference
from trellis_cli.reference import layer_pack_forward
from trellis_cli.formats.layer_pack import LayerPack

CPU_LIMIT = 1e-5
CPU_MS = (1, 7, 64)  # the CPU reference decodes every routed expert per M: keep the check to minutes at most
TOP_K = 8


def shared_inputs(pack: LayerPack, m: int, seed: int, device: torch.device):
    """Activations and routes, the same on every rank: drawn on the CPU (a GPU's generator may depend on the
    GPU model), then moved to this rank's device."""
    experts = int(pack.global_to_combined.shape[0])
    x = random_activations(m, pack.hidden, device="cpu", seed=seed)
    ids, weights = random_routes(m, experts, min(TOP_K, experts), device="cpu", seed=seed + 1)
    return x.to(device), ids.to(device), weights.to(device)


def _partial(pack: LayerPack, runner, x, ids, weights) -> torch.Tensor:
    """This rank's fp32 partial output: the fused kernel when given one, else the float32 reference."""
    if runner is not None:
        return runner.forward(x, ids, weights)
    return layer_pack_forward(pack, x, ids, weights, dtype=torch.float32)


def check_m(plan: TpPlan, pack: LayerPack, runner, m: int, seed: int, device: torch.device) -> list[Check]:
    """The two checks for one M; collective, so every rank calls it; only rank 0 returns the checks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    limit = CPU_LIMIT if runner is None else REFERENCE_LIMIT
    x, ids, weights = shared_inputs(pack, m, seed, device)
    partial = _partial(pack, runner, x, ids, weights)
    slice_ref = layer_pack_forward(pack, x, ids, weights, dtype=torch.float64)
    slice_errors: list[float | None] = [None] * world
    dist.all_gather_object(slice_errors, rel_l2(partial, slice_ref) if bool(torch.isfinite(partial).all())
                           else float("inf"))
    reduced = partial.clone()
    dist.all_reduce(reduced)
    if not plan.has_whole_layer:
        dist.all_reduce(slice_ref)  # the layer is its slices: their float64 sum is its reference
    if rank != 0:
        return []
    whole = whole_layer_reference(plan, x, ids, weights)
    if whole is None:  # the layer is its rank slices
        whole = slice_ref
    errors = cast("list[float]", slice_errors)  # every rank sent its own
    worst = max(range(world), key=lambda r: errors[r])
    value = rel_l2(reduced, whole)
    finite = bool(torch.isfinite(reduced).all())
    what = "the whole layer" if plan.has_whole_layer else "the sum of the rank slices"
    return [
        Check("rank slice vs float64", f"M={m} worst rank {worst}", errors[worst], limit,
              errors[worst] <= limit, f"per rank: {', '.join(f'{e:.2e}' for e in errors)}"),
        Check(f"TP{world} all-reduce vs float64", f"M={m}", value, limit, finite and value <= limit,
              f"reference: {what}" + ("" if finite else "; non-finite output")),
    ]


def rank_smoke(plan: TpPlan, pack: LayerPack, runner, device: torch.device, *, seed: int,
               log=lambda s: None) -> list[Check]:
    checks: list[Check] = []
    for m in (CPU_MS if runner is None else SMOKE_MS):
        log(f"smoke: TP{dist.get_world_size()} M={m}")
        checks += check_m(plan, pack, runner, m, seed + m, device)
    return checks
