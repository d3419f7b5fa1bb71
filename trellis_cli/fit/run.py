"""`fit(checkpoint, request) -> FitResult`: weights per rank, KV per token, reserve, budget, verdict, remedies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import require_intact
from trellis_cli.dialects.registry import ROUTE_PACK, storage_of
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.fit.arch import Arch, read_arch
from trellis_cli.fit.budget import Outcome, RankBudget, outcome, rank_budgets, usable_bytes
from trellis_cli.fit.gpus import Gpu
from trellis_cli.fit.kv import KV_DTYPES, KvPerToken, kv_per_token
from trellis_cli.fit.remedies import Remedy, find_remedies
from trellis_cli.fit.reserve import Term, reserve_terms
from trellis_cli.fit.sharding import ENGINE_SOURCES, ENGINES
from trellis_cli.fit.weights import Weights, rank_weights, scan, styles_shown
from trellis_cli.fit.weights import to_json as weights_json

DEFAULT_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's --max-num-seqs default
DEFAULT_BATCHED_TOKENS = 8192  # vLLM's --max-num-batched-tokens default for the API server on large GPUs
# Cheapest first: the smaller KV layouts, in falling bytes per token.
KV_REMEDY_ORDER = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")


@dataclass(frozen=True)
class FitRequest:
    tp: int
    gpu: Gpu
    dcp: int = 1
    ctx: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    kv_dtype: str = "auto"
    gpu_memory_utilization: float = DEFAULT_UTILIZATION
    engine: str = "vllm"
    mtp: bool = False  # the engine loads the MTP layers (speculative decoding with MTP)
    max_batched_tokens: int = DEFAULT_BATCHED_TOKENS


@dataclass
class FitResult:
    request: FitRequest
    arch: Arch
    ctx: int
    kv: KvPerToken
    reserve: list[Term]
    weights: Weights
    ranks: list[RankBudget]
    fits: bool
    pool_tokens: int
    short_by_bytes: int
    remedies: list[Remedy] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def longest_context(self) -> int:
        """The longest context every one of max_num_seqs sequences can have at once."""
        return self.pool_tokens // self.request.max_num_seqs

    def to_json(self) -> dict[str, Any]:
        r = self.request
        return {
            "tp": r.tp, "dcp": r.dcp, "kv_dtype": r.kv_dtype, "ctx": self.ctx, "max_num_seqs": r.max_num_seqs,
            "max_num_batched_tokens": r.max_batched_tokens, "engine": r.engine, "engine_source": ENGINE_SOURCES[r.engine],
            "mtp_loaded": r.mtp, "gpu": {"name": r.gpu.name, "description": r.gpu.description,
                                         "total_bytes": r.gpu.total_bytes},
            "gpu_memory_utilization": r.gpu_memory_utilization,
            "kv_bytes_per_token": self.kv.rank_bytes,
            "kv": {"latent_bytes_per_layer": self.kv.latent_per_layer, "latent_layers": self.kv.latent_layers,
                   "indexer_bytes_per_layer": self.kv.indexer_per_layer, "indexer_layers": self.kv.indexer_layers,
                   "bytes_per_token_all_ranks": self.kv.all_ranks_bytes},
            "reserve": [{"name": t.name, "bytes": t.bytes, "source": t.source, "estimate": t.estimate}
                        for t in self.reserve],
            "sharding": styles_shown(self.weights),
            "mtp_skipped_bytes": self.weights.mtp_skipped_bytes,
            "ranks": [{"rank": b.rank, "expert_bytes": b.expert_bytes, "weight_bytes": b.weight_bytes,
                       "absent_weight_bytes": b.absent_bytes, "reserve_bytes": b.reserve_bytes,
                       "usable_bytes": b.usable_bytes, "kv_budget_bytes": b.kv_budget_bytes,
                       "kv_tokens": b.kv_tokens, **weights_json(b.weights)} for b in self.ranks],
            "kv_tokens": self.pool_tokens, "longest_context": self.longest_context,
            "fits": self.fits, "short_by_bytes": self.short_by_bytes,
            "remedies": [m.to_json() for m in self.remedies], "notes": list(self.notes),
        }


def check_request(r: FitRequest) -> None:
    def positive(name: str, value: int | None) -> None:
        if value is not None and value < 1:
            raise UsageError(f"{name} must be at least 1, got {value}")

    for name, value in (("--tp", r.tp), ("--dcp", r.dcp), ("--ctx", r.ctx), ("--max-num-seqs", r.max_num_seqs),
                        ("--max-num-batched-tokens", r.max_batched_tokens)):
        positive(name, value)
    if r.tp % r.dcp:
        raise UsageError(f"--dcp {r.dcp} must divide --tp {r.tp} (decode context parallelism runs inside the TP group)")
    if not 0 < r.gpu_memory_utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {r.gpu_memory_utilization}")
    if r.kv_dtype not in KV_DTYPES:
        raise UsageError(f"--kv-dtype: unknown {r.kv_dtype!r} (known: {', '.join(KV_DTYPES)})")
    if r.engine not in ENGINES:
        raise UsageError(f"--engine: unknown {r.engine!r} (known: {', '.join(ENGINES)})")


def check_split(arch: Arch, tp: int) -> None:
    """What the engine refuses at load: attention heads that do not divide among the TP ranks."""
    if arch.heads % tp:
        raise UsageError(f"--tp {tp}: the engine splits the {arch.heads} attention heads (num_attention_heads) "
                         f"evenly over the ranks and refuses a TP that does not divide them")


class _Evaluator:
    """Budgets for a request and its variations, computing each TP's weights once."""

    def __init__(self, ckpt: Checkpoint, arch: Arch, ctx: int, engine: str) -> None:
        self.ckpt, self.arch, self.ctx = ckpt, arch, ctx
        self.inventory = scan(ckpt, arch, ENGINES[engine])
        self.weights: dict[tuple[int, bool, bool], Weights] = {}

    def weights_for(self, r: FitRequest, reslice: bool = False) -> Weights:
        key = (r.tp, r.mtp, reslice)
        if key not in self.weights:
            self.weights[key] = rank_weights(self.ckpt, self.arch, self.inventory, r.tp, r.mtp, reslice)
        return self.weights[key]

    def parts(self, r: FitRequest, reslice: bool = False):
        check_split(self.arch, r.tp)
        weights = self.weights_for(r, reslice)
        kv = kv_per_token(self.arch, r.kv_dtype, r.dcp, r.mtp)
        reserve = reserve_terms(self.arch, r.tp, r.dcp, r.max_num_seqs, r.max_batched_tokens)
        usable = usable_bytes(r.gpu.total_bytes, r.gpu_memory_utilization)
        ranks = rank_budgets(weights, sum(t.bytes for t in reserve), usable, kv, self.ctx)
        return weights, kv, reserve, ranks

    def outcome(self, r: FitRequest) -> Outcome | None:
        """The outcome of a variation; None when that variation cannot be evaluated (e.g. an illegal split)."""
        try:
            return outcome(self.parts(r, reslice=True)[3])
        except (UsageError, CheckFailed):
            return None


def fit(ckpt: Checkpoint, request: FitRequest) -> FitResult:
    check_request(request)
    if storage_of(ckpt) == ROUTE_PACK:
        raise UsageError("a route pack is the kernel's layout of one checkpoint's experts only: run fit on the "
                         "checkpoint it was made from")
    require_intact(ckpt, "fit")  # weights counted from files that could not all be read would be a lie
    arch = read_arch(ckpt.config)
    check_split(arch, request.tp)
    ctx = request.ctx or arch.max_positions
    if ctx is None:
        raise UsageError("config.json has no max_position_embeddings: give --ctx TOKENS")
    ev = _Evaluator(ckpt, arch, ctx, request.engine)
    weights, kv, reserve, ranks = ev.parts(request)
    base = outcome(ranks)
    result = FitResult(request, arch, ctx, kv, reserve, weights, ranks, base.fits(ctx), base.pool_tokens,
                       base.short_bytes)
    result.notes = _notes(result)
    if not result.fits:
        resliced = any(layer.rank_sliced for layer in ckpt.layers.values())
        result.remedies = find_remedies(
            request, base, ctx, request.gpu.total_bytes, kv.bytes_for, ev.outcome, KV_REMEDY_ORDER,
            "needs the checkpoint re-sliced for that TP, trellis repack --to tr3 --tp N; weights estimated "
            "as an equal share per rank" if resliced else "")
    return result


def _notes(result: FitResult) -> list[str]:
    notes = []
    arch, r = result.arch, result.request
    if arch.max_positions is not None and result.ctx > arch.max_positions:
        notes.append(f"--ctx {result.ctx} is beyond the model's max_position_embeddings {arch.max_positions}")
    absent = sorted({p for b in result.ranks for p in b.weights.absent})
    if absent:
        notes.append(f"not in the checkpoint, estimated at bf16 from config.json: {', '.join(absent)}")
    if result.weights.mtp_skipped_bytes and not r.mtp:
        notes.append("the MTP layer is stored but not loaded (give --mtp when serving with MTP speculative decoding)")
    if r.mtp and arch.mtp_layers == 0:
        notes.append("--mtp: config.json declares no MTP layers (num_nextn_predict_layers 0)")
    return notes


__all__ = ["DEFAULT_MAX_NUM_SEQS", "DEFAULT_UTILIZATION", "FitRequest", "FitResult", "check_request", "fit"]
