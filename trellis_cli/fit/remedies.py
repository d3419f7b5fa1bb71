"""The cheapest changes that would make a checkpoint fit, each with its numbers (docs/fit.md, "Remedies").

Each candidate is evaluated by the same budget as the answer itself (`evaluate`, handed in by run.py) at the
expensive end of every measured term, and by the engine's own refusals (a dtype or DCP the engine does not
serve on this GPU family is never offered): another KV dtype, a DCP degree, another utilization, demoting
routed experts from the highest K tier to the next (bytes from the checkpoint's own per-K sizes on each rank,
never a bit ratio), a higher TP. Where no single change fits, the smallest combination that does, every
option spelled with its value.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable

from trellis_cli.fit.budget import Outcome, RankBudget

MAX_UTILIZATION = 0.98
TP_STEPS = (2, 4, 8, 16)


@dataclass(frozen=True)
class Remedy:
    kind: str  # kv-dtype | dcp | utilization | demote | tp | combined
    change: str  # the options or action with their values, e.g. "--kv-dtype fp8 --dcp 4"
    numbers: dict[str, Any]
    note: str = ""
    changes: dict[str, Any] = dataclasses.field(default_factory=dict)  # the request fields it changes

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "change": self.change, **self.numbers, **({"note": self.note} if self.note else {})}


def find_remedies(request: Any, base: Outcome, ctx: int, evaluate: Callable[[Any], Outcome | None],
                  kv_dtypes: tuple[str, ...], sliced_tp: int | None = None) -> list[Remedy]:
    found: list[Remedy] = []

    def numbers(o: Outcome) -> dict[str, Any]:
        return {"kv_tokens": o.pool_tokens, "longest_context": o.pool_tokens // request.seqs, "fits": o.fits(ctx)}

    def fits(changes: dict[str, Any]) -> Outcome | None:
        o = evaluate(dataclasses.replace(request, **changes))
        return o if o is not None and o.fits(ctx) else None

    dtypes = [d for d in kv_dtypes if d != request.kv_dtype]
    dcps = [d for d in range(request.dcp + 1, request.tp + 1) if request.tp % d == 0]
    single: list[tuple[str, dict[str, Any]]] = []
    single += [("kv-dtype", {"kv_dtype": d}) for d in dtypes]
    single += [("dcp", {"dcp": d}) for d in dcps]
    for kind, changes in single:
        if any(r.kind == kind for r in found):
            continue
        o = fits(changes)
        if o is not None:
            found.append(Remedy(kind, spell(changes), numbers(o), changes=changes))
    u = utilization_for(base.ranks, request)
    if u is not None and u != request.utilization:
        o = fits({"gpu_memory_utilization": u})
        if o is not None:
            found.append(Remedy("utilization", spell({"gpu_memory_utilization": u}), numbers(o),
                                changes={"gpu_memory_utilization": u}))
    demote = demotion(base.ranks)
    if demote is not None:
        found.append(demote)
    if not found:  # no single change: the smallest combination that fits
        combined = _combination(request, dtypes, dcps, evaluate, fits)
        if combined is not None:
            changes, o = combined
            found.append(Remedy("combined", spell(changes), numbers(o), "no single change fits; together these do",
                                changes))
    for tp in TP_STEPS:
        if tp <= request.tp:
            continue
        o = fits({"tp": tp})
        if o is not None:
            note = (f"needs the checkpoint re-sliced: trellis repack SOURCE OUT --to tr3 --tp {tp}; weights "
                    "estimated as an equal share per rank") if sliced_tp is not None and sliced_tp != tp else ""
            found.append(Remedy("tp", spell({"tp": tp}), numbers(o) | {"gpus": tp}, note, {"tp": tp}))
            break
    return found


def _combination(request: Any, dtypes: list[str], dcps: list[int], evaluate, fits):
    """The first of (dtype, DCP), then either with a utilization, then all three, that fits."""
    pairs: list[dict[str, Any]] = [{"kv_dtype": d, "dcp": p} for d, p in itertools.product(dtypes, dcps)]
    for changes in pairs:
        o = fits(changes)
        if o is not None:
            return changes, o
    singles: list[dict[str, Any]] = [{"kv_dtype": d} for d in dtypes] + [{"dcp": p} for p in dcps]
    for changes in singles + pairs:
        o = evaluate(dataclasses.replace(request, **changes))
        if o is None:
            continue
        u = utilization_for(o.ranks, dataclasses.replace(request, **changes))
        if u is None:
            continue
        with_u = changes | {"gpu_memory_utilization": u}
        o = fits(with_u)
        if o is not None:
            return with_u, o
    return None


OPTION = {"kv_dtype": "--kv-dtype", "dcp": "--dcp", "gpu_memory_utilization": "--gpu-memory-utilization",
          "tp": "--tp"}


def spell(changes: dict[str, Any]) -> str:
    parts = []
    for key in ("tp", "dcp", "kv_dtype", "gpu_memory_utilization"):
        if key in changes:
            value = changes[key]
            parts.append(f"{OPTION[key]} {value:.3f}" if isinstance(value, float) else f"{OPTION[key]} {value}")
    return " ".join(parts)


def utilization_for(ranks: list[RankBudget], request: Any) -> float | None:
    """The utilization (3 decimals, up) at which every rank holds its weights, its reserve and the context's
    KV; None past MAX_UTILIZATION. A rank that cannot start (free memory below the request) needs a lower one."""
    total = request.gpu.total_bytes
    if any(r.start_short_bytes for r in ranks):
        free = min(r.usable_bytes - r.start_short_bytes for r in ranks)
        return math.floor(free * 1000 / total) / 1000 or None
    need = max(r.weight_bytes + r.absent_bytes + r.reserve_bytes + r.needed_bytes for r in ranks)
    u = -(-need * 1000 // total) / 1000
    return u if u <= MAX_UTILIZATION else None


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
