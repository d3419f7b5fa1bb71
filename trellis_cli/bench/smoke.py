"""The smoke oracle: is the fused kernel computing the reference forward on this GPU?

For each partition and M: the fused one-launch result against the float64 reference (rel L2 <= 1e-3) and
against the two-pass baseline (the same kernel once per tier, outputs summed; rel L2 <= 1e-4, which
catches numerically unsafe tiles at large M). On the mixed partition also: repeat runs and CUDA-graph
replay bit-identical to eager, an unmapped expert contributing exactly zero, and two different partitions
served by one compiled object. Every check draws fresh random inputs and routes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

from trellis_cli.bench.synthetic import random_activations, random_routes
from trellis_cli.kernel.abi import KernelLibrary
from trellis_cli.kernel.launch import FusedMoe
from trellis_cli.reference import layer_pack_forward
from trellis_cli.formats.layer_pack import LayerPack

REFERENCE_LIMIT = 1e-3
TWO_PASS_LIMIT = 1e-4
SMOKE_MS = (1, 3, 64, 3072)
DETERMINISM_MS = (64, 3072)


@dataclass
class Check:
    name: str
    case: str  # partition and M
    value: float | None
    limit: float | None
    passed: bool
    detail: str = ""


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm()
    return float(diff / max(float(ref.double().norm()), 1e-30))


def _inputs(moe: FusedMoe, m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pack = moe.pack
    experts = int(pack.global_to_combined.shape[0])
    x = random_activations(m, pack.hidden, device=moe.device, seed=seed)
    ids, weights = random_routes(m, experts, 8 if experts >= 8 else experts, device=moe.device, seed=seed + 1)
    return x, ids, weights


def accuracy_checks(moe: FusedMoe, label: str, m: int, seed: int) -> list[Check]:
    x, ids, weights = _inputs(moe, m, seed)
    fused = moe.forward(x, ids, weights)
    two_pass = moe.two_pass(x, ids, weights)
    ref = layer_pack_forward(moe.pack, x, ids, weights, dtype=torch.float64)
    case = f"{label} M={m}"
    finite = bool(torch.isfinite(fused).all())
    vs_ref, vs_two = rel_l2(fused, ref), rel_l2(fused, two_pass)
    return [
        Check("fused vs float64", case, vs_ref, REFERENCE_LIMIT, finite and vs_ref <= REFERENCE_LIMIT,
              "" if finite else "non-finite output"),
        Check("fused vs two-pass", case, vs_two, TWO_PASS_LIMIT, vs_two <= TWO_PASS_LIMIT),
        Check("two-pass vs float64", case, rel_l2(two_pass, ref), REFERENCE_LIMIT,
              rel_l2(two_pass, ref) <= REFERENCE_LIMIT),
    ]


def determinism_checks(moe: FusedMoe, label: str, m: int, seed: int) -> list[Check]:
    x, ids, weights = _inputs(moe, m, seed)
    eager = moe.forward(x, ids, weights).clone()
    repeat = moe.forward(x, ids, weights).clone()
    static = torch.full_like(eager, float("nan"))
    stream = torch.cuda.Stream(moe.device)
    stream.wait_stream(torch.cuda.current_stream(moe.device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        moe.forward(x, ids, weights, out=static)  # warm-up on the capture stream
        static.fill_(float("nan"))
        with torch.cuda.graph(graph, stream=stream):
            moe.forward(x, ids, weights, out=static)
    torch.cuda.current_stream(moe.device).wait_stream(stream)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize(moe.device)
    case = f"{label} M={m}"
    return [
        Check("repeat bit-identical", case, None, None, torch.equal(eager, repeat)),
        Check("graph replay == eager", case, None, None, torch.equal(eager, static)),
    ]


def unmapped_check(moe: FusedMoe, label: str, m: int, seed: int) -> Check:
    """Unmapping a routed expert must equal giving its routes zero weight, bit for bit."""
    x, ids, weights = _inputs(moe, m, seed)
    expert = int(ids[0, 0])
    g2c = moe.pack.global_to_combined.clone()
    g2c[expert] = -1
    unmapped = FusedMoe(dataclasses.replace(moe.pack, global_to_combined=g2c), moe.library, moe.device)
    zeroed = weights.masked_fill(ids == expert, 0.0)
    same = torch.equal(unmapped.forward(x, ids, weights), moe.forward(x, ids, zeroed))
    return Check("unmapped expert contributes zero", f"{label} M={m} expert {expert}", None, None, same)


def partition_reuse_checks(packs: list[tuple[str, LayerPack]], library: KernelLibrary, m: int,
                           seed: int) -> list[Check]:
    """ABA over two partitions through one loaded library: each run must match the reference."""
    checks = []
    order = [packs[0], packs[1], packs[0]]
    for step, (label, pack) in enumerate(order):
        moe = FusedMoe(pack, library)
        x, ids, weights = _inputs(moe, m, seed + step)
        value = rel_l2(moe.forward(x, ids, weights), layer_pack_forward(moe.pack, x, ids, weights))
        checks.append(Check("one object, two partitions", f"{label} M={m} step {step + 1}/3", value,
                            REFERENCE_LIMIT, value <= REFERENCE_LIMIT, f"library {library.build_hash}"))
    return checks


def run_smoke(packs: list[tuple[str, LayerPack]], library: KernelLibrary, *, ms=SMOKE_MS, seed: int = 1,
              reuse_pack: tuple[str, LayerPack] | None = None, log: Callable[[str], None] = lambda s: None
              ) -> list[Check]:
    """All smoke checks. `packs` are (label, pack) with the mixed one last; `reuse_pack` a second partition."""
    checks: list[Check] = []
    for index, (label, pack) in enumerate(packs):
        moe = FusedMoe(pack, library)
        for m in ms:
            log(f"smoke: {label} M={m}, plan: {moe.plan(m, min(8, int(pack.global_to_combined.shape[0]))).describe()}")
            checks += accuracy_checks(moe, label, m, seed + 100 * index + m)
        if index == len(packs) - 1:
            for m in DETERMINISM_MS:
                checks += determinism_checks(moe, label, m, seed + 7 * m)
            checks.append(unmapped_check(moe, label, 64, seed + 5))
            if reuse_pack is not None:
                checks += partition_reuse_checks([(label, pack), reuse_pack], library, 64, seed + 11)
        del moe
        torch.cuda.empty_cache()
    return checks
