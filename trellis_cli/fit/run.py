"""`fit(checkpoint, request) -> FitResult`: the engine version's layout and defaults on the GPU family, weights per
rank, KV per token, reserve, budget, the verdict over the reserve's band, and remedies. `fit_source(source,
request)` opens the checkpoint first: the one call behind `trellis fit`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import require_intact
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.fit.arch import Arch, read_arch
from trellis_cli.fit.budget import Outcome, RankBudget, outcome, rank_budgets
from trellis_cli.fit.engines import (DEFAULT_ENGINE, KV_DTYPES, EngineRefusal, EngineVersion, KvLayout,
                                     default_max_batched_tokens, default_max_num_seqs, engine_version,
                                     resolve_layout)
from trellis_cli.fit.gpus import Gpu
from trellis_cli.fit.kv import KvPerToken, kv_per_token
from trellis_cli.fit.remedies import Remedy, find_remedies
from trellis_cli.fit.reserve import CASES, Term, reserve_terms
from trellis_cli.fit.sharding import ENGINE_SOURCES, ENGINES
from trellis_cli.fit.weights import Inventory, Weights, rank_weights, scan, scan_columns, styles_shown
from trellis_cli.fit.weights import to_json as weights_json
from trellis_cli.sources import SourceArg

FITS, MARGINAL, SHORT = "fits", "marginal", "does not fit"
MAX_CTX = 1 << 40  # past any model's positions: a larger --ctx is a typo
# Cheapest first: the smaller KV layouts, in falling bytes per token.
KV_REMEDY_ORDER = ("fp8", "fp8_ds_mla", "nvfp4_ds_mla")


@dataclass(frozen=True)
class FitRequest:
    tp: int
    gpu: Gpu
    dcp: int = 1
    ctx: int | None = None  # None: the model's max_position_embeddings
    ctx_auto: bool = False  # the longest context that fits (the engine's "estimated maximum model length")
    max_num_seqs: int | None = None  # None: the engine's default for this GPU
    kv_dtype: str = "auto"
    gpu_memory_utilization: float | None = None  # None: the engine version's default
    engine: str = DEFAULT_ENGINE
    mtp: bool = False  # the engine loads the MTP layers (speculative decoding with MTP)
    max_batched_tokens: int | None = None  # None: the engine's default for this GPU
    mem_in_use: int = 0  # memory other processes already hold on each card
    kv_fp8_rope: bool = False  # KV_FP8_ROPE=1: the b12x nvfp4 record keeps its RoPE part in fp8
    allow_long_context: bool = False  # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1

    @property
    def version(self) -> EngineVersion:
        return engine_version(self.engine)

    @property
    def utilization(self) -> float:
        u = self.gpu_memory_utilization
        return self.version.default_utilization if u is None else u

    @property
    def seqs(self) -> int:
        return self.max_num_seqs if self.max_num_seqs is not None else default_max_num_seqs(self.gpu.total_bytes)

    @property
    def batched(self) -> int:
        b = self.max_batched_tokens
        return b if b is not None else default_max_batched_tokens(self.gpu.total_bytes)


@dataclass
class FitResult:
    request: FitRequest
    arch: Arch
    ctx: int
    kv: KvPerToken
    reserve: list[Term]
    weights: Weights
    ranks: list[RankBudget]  # at the typical value of every measured term
    fits: bool  # over the whole band
    pool_tokens: int
    short_by_bytes: int
    verdict: str = FITS
    band: dict[str, Outcome] = field(default_factory=dict)  # case -> outcome
    deciding_term: str | None = None
    resliced_to: int | None = None  # the TP the answer assumes after re-slicing a rank-sliced checkpoint
    remedies: list[Remedy] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dialect: str = ""  # the checkpoint's dialect, as open_checkpoint named it

    @property
    def layout(self) -> KvLayout:
        return self.kv.layout

    @property
    def longest_context(self) -> int:
        """The longest context every one of max_num_seqs sequences can have at once."""
        return self.pool_tokens // self.request.seqs

    @property
    def concurrent_requests(self) -> int:
        """How many `ctx`-token requests the pool serves at once (the engine's maximum concurrency), at most
        max_num_seqs."""
        blocks = self.pool_tokens // self.kv.block_tokens
        per_request = self.kv.blocks_for(self.ctx)
        return min(self.request.seqs, blocks // per_request) if per_request else 0

    def to_json(self) -> dict[str, Any]:
        r = self.request
        version = r.version
        return {
            "tp": r.tp, "dcp": r.dcp, "kv_dtype": r.kv_dtype, "ctx": self.ctx, "ctx_auto": r.ctx_auto,
            "max_num_seqs": r.seqs, "max_num_batched_tokens": r.batched,
            "engine": version.name, "engine_label": version.label, "engine_version_source": version.source,
            "engine_source": ENGINE_SOURCES["vllm"],
            "gpu_family": r.gpu.family, "resliced_to_tp": self.resliced_to,
            "mtp_loaded": r.mtp, "gpu": {"name": r.gpu.name, "description": r.gpu.description,
                                         "total_bytes": r.gpu.total_bytes, "family": r.gpu.family,
                                         "in_use_bytes": r.mem_in_use},
            "gpu_memory_utilization": r.utilization,
            "kv_layout": {"asked": self.layout.asked, "stored": self.layout.stored, "backend": self.layout.backend,
                          "source": self.layout.source},
            "kv_bytes_per_token": self.kv.rank_bytes,
            "kv": {"latent_bytes_per_layer": self.kv.latent_per_layer, "latent_layers": self.kv.latent_layers,
                   "indexer_bytes_per_layer": self.kv.indexer_per_layer, "indexer_layers": self.kv.indexer_layers,
                   "bytes_per_token_all_ranks": self.kv.all_ranks_bytes, "block_tokens": self.kv.block_tokens,
                   "block_bytes_per_rank": self.kv.block_bytes},
            "reserve": [{"name": t.name, "bytes": t.typical, "low": t.low, "typical": t.typical, "high": t.high,
                         "source": t.source, "estimate": t.measured, "outside_budget": t.outside}
                        for t in self.reserve],
            "sharding": styles_shown(self.weights),
            "mtp_skipped_bytes": self.weights.mtp_skipped_bytes,
            "mtp_shared_bytes": self.weights.mtp_shared_bytes,
            "ranks": [{"rank": b.rank, "expert_bytes": b.expert_bytes, "stored_weight_bytes": b.weight_bytes,
                       "absent_weight_bytes": b.absent_bytes, "weight_bytes": b.weight_bytes + b.absent_bytes,
                       "reserve_bytes": b.reserve_bytes, "usable_bytes": b.usable_bytes,
                       "kv_budget_bytes": b.kv_budget_bytes, "kv_tokens": b.kv_tokens,
                       **weights_json(b.weights)} for b in self.ranks],
            "kv_tokens": self.pool_tokens, "longest_context": self.longest_context,
            "concurrent_requests": self.concurrent_requests,
            "band": {case: {"kv_tokens": o.pool_tokens, "short_by_bytes": o.short_bytes,
                            "start_short_bytes": o.start_short_bytes, "fits": o.fits(self.ctx)}
                     for case, o in self.band.items()},
            "verdict": self.verdict, "deciding_term": self.deciding_term,
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
    if r.ctx is not None and r.ctx > MAX_CTX:
        raise UsageError(f"--ctx {r.ctx:.3e} is past any model's positions")
    if r.tp > 1024:
        raise UsageError(f"--tp {r.tp}: more GPUs than any node or cluster fit models (1024 at most)")
    if r.tp % r.dcp:
        raise UsageError(f"--dcp {r.dcp} must divide --tp {r.tp} (decode context parallelism runs inside the TP group)")
    u = r.gpu_memory_utilization
    if u is not None and not 0 < u <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {u}")
    if r.kv_dtype not in KV_DTYPES:
        raise UsageError(f"--kv-dtype: unknown {r.kv_dtype!r} (known: {', '.join(KV_DTYPES)})")
    r.version  # an unknown --engine is a usage error
    if r.gpu.family is None:
        raise UsageError("the GPU family is not known: give --arch sm_90, sm_100 or sm_120, or --gpu NAME")
    if r.mem_in_use < 0 or r.mem_in_use >= r.gpu.total_bytes:
        raise UsageError(f"--gpu-mem-used must be less than the GPU's {r.gpu.total_bytes:,} B")


def check_split(arch: Arch, tp: int) -> None:
    """What the engine refuses at load: attention heads that do not divide among the TP ranks."""
    if arch.heads % tp:
        raise UsageError(f"--tp {tp}: the engine splits the {arch.heads} attention heads (num_attention_heads) "
                         f"evenly over the ranks and refuses a TP that does not divide them")


def check_engine_loads(ckpt: Checkpoint, version: EngineVersion) -> None:
    """An engine without an EXL3 quantization method refuses an EXL3 checkpoint at config time."""
    quant = ckpt.config.get("quantization_config") if isinstance(ckpt.config, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "exl3" and not version.loads_exl3:
        raise EngineRefusal(f"{version.label} has no exl3 quantization method (model_executor/layers/quantization/"
                            "__init__.py: QUANTIZATION_METHODS) and refuses this checkpoint's quant_method exl3",
                            f"--engine {DEFAULT_ENGINE}")


class _Evaluator:
    """Budgets for a request and its variations, computing each TP's weights once."""

    def __init__(self, ckpt: Checkpoint, arch: Arch, ctx: int, reserve_ctx: int,
                 inventory: Inventory | None = None) -> None:
        self.ckpt, self.arch, self.ctx, self.reserve_ctx = ckpt, arch, ctx, reserve_ctx
        self.inventory = inventory if inventory is not None else scan(ckpt, arch, ENGINES["vllm"])
        self.weights: dict[tuple[int, bool, bool], Weights] = {}

    def weights_for(self, r: FitRequest, reslice: bool = False) -> Weights:
        key = (r.tp, r.mtp, reslice)
        if key not in self.weights:
            self.weights[key] = rank_weights(self.ckpt, self.arch, self.inventory, r.tp, r.mtp, reslice)
        return self.weights[key]

    def layout(self, r: FitRequest) -> KvLayout:
        a = self.arch
        return resolve_layout(r.version, r.gpu.family or "", r.kv_dtype, r.dcp, a.heads // r.tp, a.kv_lora_rank,
                              a.qk_rope, r.kv_fp8_rope)

    def parts(self, r: FitRequest, reslice: bool = False, ctx: int | None = None):
        check_split(self.arch, r.tp)
        weights = self.weights_for(r, reslice)
        kv = kv_per_token(self.arch, self.layout(r), r.dcp, r.mtp, r.version)
        terms = reserve_terms(self.arch, r.version, r.tp, r.dcp, r.seqs, r.batched, self.reserve_ctx, r.mtp)
        ctx = self.ctx if ctx is None else ctx
        band = {case: outcome(rank_budgets(weights, terms, r.gpu.total_bytes, r.utilization, r.mem_in_use, kv, ctx,
                                           r.version.extensible_kv_cache, case)) for case in CASES}
        return weights, kv, terms, band

    def outcome(self, r: FitRequest) -> Outcome | None:
        """The outcome of a variation at the expensive end of every band; None when the engine refuses it
        or it cannot be evaluated (e.g. an illegal split)."""
        try:
            return self.parts(r, reslice=True)[3]["high"]
        except (UsageError, CheckFailed):
            return None


def fit_source(source: SourceArg, request: FitRequest,
               progress: Callable[[str, int, int], None] | None = None) -> FitResult:
    """Check `request` (a usage error before anything is read or downloaded), open `source` (a Source or a local
    path; `progress(stage, done, total)` while its headers are read) and fit it."""
    from trellis_cli.dialects.open import open_checkpoint

    check_request(request)
    quick = _from_columns(source, request, progress)
    if quick is not None:
        return quick
    return fit(open_checkpoint(source, progress=progress), request)


def _from_columns(source: Any, request: FitRequest, progress: Callable[[str, int, int], None] | None) -> FitResult | None:
    """`fit` of a local rank-sliced TR3 read without the per-tensor model: its declarations (`open_declared`),
    each shard's linears summed from its raw header (`reader.shard_columns`), the index proven from the shards'
    names or read and checked as the full opening reads it. None wherever that is not proven to be the full
    opening's answer (anything unusual in a shard, any fault of the bytes, a declaration the full opening reads
    otherwise): `fit_source` then opens in full, which words every refusal."""
    from trellis_cli.checkpoint import reader
    from trellis_cli.checkpoint.model import MIN_COUNT_LIMIT
    from trellis_cli.dialects.open import open_declared, paused_gc
    from trellis_cli.findings import Severity
    from trellis_cli.sources import LocalSource

    if isinstance(source, (str, Path)):
        source = LocalSource(Path(source))
    if getattr(source, "root", None) is None:
        return None  # a Hub source: its headers are fetched in parallel by the full opening
    ckpt = open_declared(source)
    if ckpt is None or source.special or source.unlistable or ckpt.tp > MIN_COUNT_LIMIT or \
            any(f.severity is Severity.ERROR for f in ckpt.parse_findings):
        return None  # (a TP above the limit is read otherwise once the tensors are counted)
    try:
        arch = read_arch(ckpt.config)
    except (UsageError, CheckFailed):
        return None
    with paused_gc(), reader.IndexProof(source, ckpt.files) as proof:  # the index proven as the shards arrive
        shards = reader.shard_columns(source, ckpt.files, progress or (lambda _stage, _done, _total: None), proof)
        if shards is None:
            return None
        named = reader.index_files(source, ckpt.files, shards.names(), proof)
        if named is None:  # read as the full opening reads it
            found = reader.read_index(source, ckpt.files, ckpt.parse_findings)
            if found is not None:
                ckpt.index_file, ckpt.index, ckpt.index_metadata = found
    if next(reader.byte_faults(ckpt), None) is not None:
        return None
    if named and any(reader.escapes(source, file) or file not in ckpt.files for file in named):
        return None  # a fault of the index's (`byte_faults` words it)
    inventory = scan_columns(ckpt, arch, ENGINES["vllm"], shards)
    if inventory is None:
        return None
    return fit(ckpt, request, inventory)


def fit(ckpt: Checkpoint, request: FitRequest, inventory: Inventory | None = None) -> FitResult:
    """The fit of `request` on `ckpt`; `inventory`: its weights already scanned (`scan_columns`), where `ckpt`
    holds only its declarations."""
    check_request(request)
    refusal = dialect_of(ckpt).weights_refusal(ckpt)
    if refusal is not None:
        raise UsageError(refusal)
    require_intact(ckpt, "fit")  # weights counted from files that could not all be read would be a lie
    arch = read_arch(ckpt.config)
    check_split(arch, request.tp)
    check_engine_loads(ckpt, request.version)
    ctx = request.ctx or arch.max_positions
    if ctx is None:
        raise UsageError("config.json has no max_position_embeddings: give --ctx TOKENS")
    if arch.max_positions is not None and ctx > arch.max_positions and not request.allow_long_context:
        raise EngineRefusal(f"--ctx {ctx:,} is beyond the model's max_position_embeddings {arch.max_positions:,}: "
                            "the engine refuses a max_model_len past it (config/model.py: _get_and_verify_max_len)",
                            f"--ctx {arch.max_positions} or less, or --allow-long-context (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, "
                            "at the model's own risk)")
    if inventory is not None:
        sliced_tp = inventory.sliced_tp
    else:
        sliced_tp = next((ckpt.tp for layer in ckpt.layers.values() if layer.rank_sliced), None)
    reslice = sliced_tp is not None and sliced_tp != request.tp
    ev = _Evaluator(ckpt, arch, ctx, ctx, inventory)
    weights, kv, reserve, band = ev.parts(request, reslice=reslice)
    if request.ctx_auto:  # the longest context the whole band holds (else its cheap end), as the engine estimates
        def longest(case: str) -> int:
            return min(min(kv.estimated_max_len(b.kv_budget_bytes), kv.tokens(b.kv_budget_bytes))
                       for b in band[case].ranks)

        ctx = longest("high") or longest("low")
        ctx = min(ctx, arch.max_positions or ctx) or kv.block_tokens
        ev.ctx = ctx
        weights, kv, reserve, band = ev.parts(request, reslice=reslice)
    typical = band["typical"]
    verdict = FITS if band["high"].fits(ctx) else MARGINAL if band["low"].fits(ctx) else SHORT
    deciding = band["high"] if verdict != SHORT else band["low"]
    result = FitResult(request, arch, ctx, kv, reserve, weights, typical.ranks, verdict == FITS,
                       typical.pool_tokens, max(deciding.short_bytes, deciding.start_short_bytes),
                       verdict, band, resliced_to=request.tp if reslice else None)
    if verdict == MARGINAL:
        result.deciding_term = _deciding_term(reserve)
    result.notes = _notes(result, sliced_tp)
    result.dialect = ckpt.dialect
    if verdict != FITS:
        result.remedies = find_remedies(request, band["high"], ctx, ev.outcome, KV_REMEDY_ORDER,
                                        sliced_tp=sliced_tp)
    return result


def _deciding_term(terms: list[Term]) -> str:
    """The measured term whose band is widest: the one a measurement on the rig settles."""
    widest = max((t for t in terms if t.measured), key=lambda t: t.high - t.low)
    return widest.name


def _notes(result: FitResult, sliced_tp: int | None) -> list[str]:
    notes = []
    arch, r = result.arch, result.request
    if result.resliced_to is not None:
        notes.append(f"the checkpoint is sliced for TP {sliced_tp}; this answer is after re-slicing to TP {r.tp} "
                     f"(`trellis repack SOURCE OUT --to tr3 --tp {r.tp}`), weights per rank estimated as an equal share")
    if arch.max_positions is not None and result.ctx > arch.max_positions:
        notes.append(f"--ctx {result.ctx} is beyond the model's max_position_embeddings {arch.max_positions} "
                     "(allowed by --allow-long-context)")
    for case in ("low", "high"):
        start_short = result.band[case].start_short_bytes if result.band else 0
        if start_short:
            requested = result.ranks[0].usable_bytes
            notes.append(f"at the {'cheap' if case == 'low' else 'expensive'} end of the CUDA context and NCCL the "
                         f"engine cannot start: it requests {requested / 2**30:.2f} GiB per GPU (utilization "
                         f"{r.utilization:g}) and {start_short / 2**30:.2f} GiB of it is not free "
                         "(v1/worker/utils.py: request_memory); they must fit in total x (1 - utilization)"
                         + (" with the memory already in use" if r.mem_in_use else ""))
            break
    absent = sorted({p for b in result.ranks for p in b.weights.absent})
    if absent:
        notes.append(f"not in the checkpoint, estimated at bf16 from config.json: {', '.join(absent)}")
    if result.weights.mtp_skipped_bytes and not r.mtp:
        notes.append("the MTP layer is stored but not loaded (give --mtp when serving with MTP speculative decoding)")
    if result.weights.mtp_shared_bytes:
        notes.append("the MTP layer's embed_tokens and shared_head.head are the main model's, counted once")
    if r.mtp and arch.mtp_layers == 0:
        notes.append("--mtp: config.json declares no MTP layers (num_nextn_predict_layers 0)")
    return notes


def with_changes(request: FitRequest, **changes: Any) -> FitRequest:
    return dataclasses.replace(request, **changes)


__all__ = ["FITS", "FitRequest", "FitResult", "MARGINAL", "SHORT", "check_request", "fit"]
