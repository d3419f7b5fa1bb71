"""The budget per rank: GPU memory times utilization, less weights, less the reserve, is the KV pool."""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.fit.kv import KvPerToken
from trellis_cli.fit.weights import RankWeights, Weights


@dataclass(frozen=True)
class RankBudget:
    rank: int
    weights: RankWeights
    usable_bytes: int  # floor(total * utilization)
    reserve_bytes: int
    kv_budget_bytes: int  # may be negative: then nothing fits
    kv_tokens: int
    needed_bytes: int  # KV bytes the requested context needs on this rank

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


def usable_bytes(total: int, utilization: float) -> int:
    return int(total * utilization)


def rank_budgets(weights: Weights, reserve: int, usable: int, kv: KvPerToken, ctx: int) -> list[RankBudget]:
    needed = kv.bytes_for(ctx)
    out = []
    for rw in weights.ranks:
        budget = usable - rw.total - rw.absent_total - reserve
        out.append(RankBudget(rw.rank, rw, usable, reserve, budget, kv.tokens(budget), needed))
    return out


@dataclass(frozen=True)
class Outcome:
    pool_tokens: int  # the engine's pool: the smallest rank's
    short_bytes: int  # the largest shortfall of any rank
    ranks: list[RankBudget]

    def fits(self, ctx: int) -> bool:
        return self.pool_tokens >= ctx and self.short_bytes == 0


def outcome(ranks: list[RankBudget]) -> Outcome:
    return Outcome(min(r.kv_tokens for r in ranks), max(r.short_bytes for r in ranks), ranks)
