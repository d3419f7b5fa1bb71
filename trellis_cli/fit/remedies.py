"""The cheapest changes that would make a checkpoint fit, each with its numbers (docs/fit.md, "Remedies").

Each candidate is evaluated by the same budget as the answer itself (`evaluate`, handed in by run.py): another
KV dtype, a DCP degree, a higher utilization, demoting routed experts from the highest K tier to the next
(bytes from the checkpoint's own per-K sizes on each rank, never a bit ratio), a higher TP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from trellis_cli.fit.budget import Outcome, RankBudget

MAX_UTILIZATION = 0.98
TP_STEPS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Remedy:
    kind: str  # kv-dtype | dcp | utilization | demote | tp
    change: str  # the option or action, e.g. "--kv-dtype fp8_ds_mla"
    numbers: dict[str, Any]
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "change": self.change, **self.numbers, **({"note": self.note} if self.note else {})}


def find_remedies(request: Any, base: Outcome, ctx: int, total_bytes: int, kv_bytes_for: Callable[[int], int],
                  evaluate: Callable[[Any], Outcome | None], kv_dtypes: tuple[str, ...], reslice_note: str) -> list[Remedy]:
    found: list[Remedy] = []

    def numbers(o: Outcome) -> dict[str, Any]:
        return {"kv_tokens": o.pool_tokens, "longest_context": o.pool_tokens // request.max_num_seqs,
                "fits": o.fits(ctx)}

    for dtype in kv_dtypes:
        if dtype == request.kv_dtype:
            continue
        o = evaluate(dataclasses.replace(request, kv_dtype=dtype))
        if o is not None and o.pool_tokens > base.pool_tokens and o.fits(ctx):
            found.append(Remedy("kv-dtype", f"--kv-dtype {dtype}", numbers(o)))
            break
    for dcp in range(request.dcp + 1, request.tp + 1):
        if request.tp % dcp:
            continue
        o = evaluate(dataclasses.replace(request, dcp=dcp))
        if o is not None and o.fits(ctx):
            found.append(Remedy("dcp", f"--dcp {dcp}", numbers(o)))
            break
    utilization = _utilization_needed(base.ranks, total_bytes, kv_bytes_for(ctx))
    if request.gpu_memory_utilization < utilization <= MAX_UTILIZATION:
        o = evaluate(dataclasses.replace(request, gpu_memory_utilization=utilization))
        if o is not None and o.fits(ctx):
            found.append(Remedy("utilization", f"--gpu-memory-utilization {utilization:.3f}", numbers(o)))
    demote = demotion(base.ranks)
    if demote is not None:
        found.append(demote)
    for tp in TP_STEPS:
        if tp <= request.tp:
            continue
        o = evaluate(dataclasses.replace(request, tp=tp))
        if o is not None and o.fits(ctx):
            found.append(Remedy("tp", f"--tp {tp}", numbers(o) | {"gpus": tp}, reslice_note))
            break
    return found


def _utilization_needed(ranks: list[RankBudget], total_bytes: int, kv_needed: int) -> float:
    """The utilization at which every rank holds its weights, its reserve and the context's KV (3 decimals up)."""
    need = max(r.weight_bytes + r.absent_bytes + r.reserve_bytes + kv_needed for r in ranks)
    return -(-need * 1000 // total_bytes) / 1000


def demotion(ranks: list[RankBudget]) -> Remedy | None:
    """Demote N expert-layers from the highest K to the next K down: each saves, on every rank, the difference
    of the two tiers' mean bytes per expert there (measured from this checkpoint's headers)."""
    ks = sorted({k for r in ranks for k, t in r.weights.tiers.items() if k is not None and t.experts})
    if len(ks) < 2:
        return None
    high, low = ks[-1], ks[-2]
    need = 0
    saving_shown = 0
    for r in ranks:
        hi, lo = r.weights.tiers[high], r.weights.tiers.get(low)
        if not hi.experts or lo is None or not lo.experts:
            return None
        saving = hi.bytes // hi.experts - -(-lo.bytes // lo.experts)
        if saving <= 0:
            return None
        saving_shown = max(saving_shown, saving)
        if r.short_bytes:
            need = max(need, -(-r.short_bytes // saving))
    available = min(r.weights.tiers[high].experts for r in ranks)
    if need == 0 or need > available:
        return None
    return Remedy("demote", f"demote {need} expert-layers from K{high} to K{low}",
                  {"experts": need, "from_k": high, "to_k": low, "bytes_saved_per_expert": saving_shown,
                   "bytes_saved": need * saving_shown, "k_high_experts": available},
                  "re-quantize them at the lower K, e.g. the least-routed ones")
