"""The budget per rank, as the engine sizes it: requested memory less weights less the reserve is the KV pool.

The engine requests ceil(total x utilization) (v1/worker/utils.py: request_memory). An engine that sizes its
cache from the profile run refuses to start when the card has less free than that (the CUDA context and NCCL,
allocated before its snapshot, and memory other processes hold, all count against free memory); the
extensible cache of vLLM 0.34 instead takes the smaller of the request and what is physically free. Every
measured term is evaluated at the cheap end of its band, its typical value and its expensive end (`case`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trellis_cli.fit.kv import KvPerToken
from trellis_cli.fit.reserve import Term, in_budget, outside_budget
from trellis_cli.fit.weights import RankWeights, Weights


@dataclass(frozen=True)
class RankBudget:
    rank: int
    weights: RankWeights
    usable_bytes: int  # what the engine may use: ceil(total * utilization), or less where less is free
    reserve_bytes: int  # the reserve charged against it
    kv_budget_bytes: int  # may be negative: then nothing fits
    kv_tokens: int
    needed_bytes: int  # KV bytes the requested context needs on this rank (its blocks and the null block)
    start_short_bytes: int = 0  # free memory missing for the engine's request at start (0: it starts)

    @property
    def weight_bytes(self) -> int:
        return self.weights.total

    @property
    def expert_bytes(self) -> int:
        return self.weights.expert_bytes

    @property
    def absent_bytes(self) -> int:
        return self.weights.absent_total

    @property
    def short_bytes(self) -> int:
        """Bytes this rank lacks for the requested context (0 when it has them)."""
        return max(0, self.needed_bytes - self.kv_budget_bytes)


def requested_bytes(total: int, utilization: float) -> int:
    """request_memory: ceil(total x gpu_memory_utilization)."""
    return math.ceil(total * utilization)


def usable_bytes(total: int, utilization: float) -> int:
    return requested_bytes(total, utilization)


def rank_budgets(weights: Weights, terms: list[Term], total: int, utilization: float, in_use: int,
                 kv: KvPerToken, ctx: int, extensible: bool, case: str = "typical") -> list[RankBudget]:
    needed = kv.bytes_for(ctx)
    requested = requested_bytes(total, utilization)
    free = total - outside_budget(terms, case) - in_use  # free when the engine takes its snapshot
    usable = min(requested, free) if extensible else requested
    start_short = 0 if extensible else max(0, requested - free)
    reserve = in_budget(terms, case)
    out = []
    for rw in weights.ranks:
        budget = usable - rw.total - rw.absent_total - reserve
        out.append(RankBudget(rw.rank, rw, usable, reserve, budget, kv.tokens(budget), needed, start_short))
    return out


@dataclass(frozen=True)
class Outcome:
    pool_tokens: int  # the engine's pool: the smallest rank's
    short_bytes: int  # the largest shortfall of any rank
    ranks: list[RankBudget]
    start_short_bytes: int = 0

    def fits(self, ctx: int) -> bool:
        return self.pool_tokens >= ctx and self.short_bytes == 0 and self.start_short_bytes == 0


def outcome(ranks: list[RankBudget]) -> Outcome:
    return Outcome(min(r.kv_tokens for r in ranks), max(r.short_bytes for r in ranks), ranks,
                   max(r.start_short_bytes for r in ranks))


__all__ = ["Outcome", "RankBudget", "outcome", "rank_budgets", "requested_bytes", "usable_bytes"]
