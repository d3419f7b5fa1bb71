"""What the engine decides from the GPU it runs on, per engine version (docs/fit.md, "Engines and GPU families").

An engine version picks a sparse-MLA attention backend per GPU family (the compute capability's major: sm_90
Hopper, sm_100 datacenter Blackwell, sm_120 RTX PRO Blackwell), and the backend decides the layout the KV cache
is stored in: `--kv-cache-dtype fp8` is stored as the packed `fp8_ds_mla` record (656 B for GLM-5) by some
backends and as plain e4m3 (576 B) by others; `auto` is bf16 on one version and fp8 on another. Some
combinations start no backend at all, or refuse decode context parallelism: those are `EngineRefusal`s
naming the engine version, the source and a remedy, never a verdict. Each fact carries the file and function
it was read from.
"""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.errors import CheckFailed, UsageError

MIB = 1 << 20
GIB = 1 << 30

SM90, SM100, SM120 = "sm_90", "sm_100", "sm_120"
FAMILIES = (SM90, SM100, SM120)
FAMILY_NAMES = {SM90: "Hopper (H100, H200)", SM100: "datacenter Blackwell (B200, GB200)",
                SM120: "RTX PRO Blackwell (RTX PRO 6000, GB10)"}

# The cache layouts fit can be asked for, and the spellings vLLM's --kv-cache-dtype also takes.
KV_DTYPES = ("auto", "bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla")
KV_DTYPE_SPELLINGS = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8",
                      "fp8_ds_mla": "fp8_ds_mla", "nvfp4_ds_mla": "nvfp4_ds_mla"}

FP8_SCALE_BLOCK = 128  # fp8_ds_mla and the indexer key: one fp32 scale per 128 fp8 values


class EngineRefusal(CheckFailed):
    """The named engine version would refuse to start with these settings on this GPU family."""

    def __init__(self, reason: str, remedy: str) -> None:
        super().__init__(f"{reason}; remedy: {remedy}")
        self.reason, self.remedy = reason, remedy


@dataclass(frozen=True)
class EngineVersion:
    name: str  # the --engine value
    label: str  # shown in every report
    default_utilization: float
    extensible_kv_cache: bool  # sized after warm-up from measured memory (vLLM 0.34) vs from the profile run
    indexer_every_layer: bool  # the indexer cache on every layer (the fork) or by index_topk_freq's offset formula
    indexer_workspace_fixed: int  # bytes the engine adds to the indexer's context-sized workspace
    loads_exl3: bool  # has an `exl3` quantization method
    moe_path: str  # whose MoE kernel runs, for the reserve
    source: str


FORK = "vllm-fork"
FORK_B12X = "vllm-fork-b12x"
UPSTREAM = "vllm-0.34"

ENGINES: dict[str, EngineVersion] = {e.name: e for e in (
    EngineVersion(FORK, "vLLM fork (local-inference-lab) at 28be48fa9", 0.92, False, True, 512 * MIB, True,
                  "the fork's EXL3 MoE method (quantization/exl3.py), its prefill arena",
                  "local-inference-lab/vllm@28be48fa9"),
    EngineVersion(FORK_B12X, "vLLM fork (local-inference-lab) with the b12x sparse MLA backend "
                  "(b12x_mla_sparse.py)", 0.92, False, True, 512 * MIB, True,
                  "the fork's EXL3 MoE method (quantization/exl3.py), its prefill arena",
                  "local-inference-lab/vllm, v1/attention/backends/mla/b12x_mla_sparse.py"),
    EngineVersion(UPSTREAM, "vLLM 0.34.0", 1.0, True, False, 0, False,
                  "vLLM's fused MoE (no EXL3 method)", "vllm 0.34.0 wheel (g62d4bc3c7)"),
)}
DEFAULT_ENGINE = FORK  # what most of these users serve with
ENGINE_ALIASES = {"vllm": FORK, "fork": FORK, "fork-b12x": FORK_B12X, "b12x": FORK_B12X, "vllm-0.34.0": UPSTREAM,
                  "0.34": UPSTREAM, "upstream": UPSTREAM}


def engine_version(name: str) -> EngineVersion:
    key = name.strip().lower()
    key = ENGINE_ALIASES.get(key, key)
    if key not in ENGINES:
        raise UsageError(f"--engine: unknown {name!r} (known: {', '.join(ENGINES)})")
    return ENGINES[key]


def kv_dtype_name(text: str) -> str:
    """`--kv-dtype` in fit's words or vLLM's (`bfloat16`, `fp8_e4m3`)."""
    key = text.strip().lower()
    if key not in KV_DTYPE_SPELLINGS:
        raise UsageError(f"--kv-dtype: unknown {text!r} (known: {', '.join(KV_DTYPE_SPELLINGS)})")
    return KV_DTYPE_SPELLINGS[key]


def family_name(text: str) -> str:
    """`--arch sm_120` (also sm120, 12.0, sm_121 -> the sm_120 family: the engines test the major only)."""
    key = text.strip().lower().replace("sm_", "").replace("sm", "").replace(".", "")
    if key.isdigit() and len(key) <= 4:
        major = int(key) // 10
        family = {9: SM90, 10: SM100, 12: SM120}.get(major)
        if family is not None:
            return family
    raise UsageError(f"--arch: {text!r} is not a GPU family fit models (known: {', '.join(FAMILIES)})")


@dataclass(frozen=True)
class KvLayout:
    """What one layer's cache stores per token on this engine, family and dtype."""

    asked: str  # the --kv-dtype asked for
    stored: str  # the layout the engine stores (fp8_ds_mla, fp8_e4m3, bf16, nvfp4_ds_mla)
    backend: str
    latent_bytes: int  # per token per layer
    source: str


def _latent(arch_lora: int, arch_rope: int, stored: str, kv_fp8_rope: bool = False) -> int:
    lora, rope = arch_lora, arch_rope
    if stored == "bf16":
        return 2 * (lora + rope)
    if stored == "fp8_e4m3":
        return lora + rope
    if stored == "fp8_ds_mla":  # fp8 latent, an fp32 scale per 128 values, the RoPE part kept in bf16
        return lora + 4 * (lora // FP8_SCALE_BLOCK) + 2 * rope
    if stored == "nvfp4_ds_mla":  # e2m1 latent (2 per byte), e4m3 RoPE, one e4m3 scale per 16 values
        return lora // 2 + rope + lora // 16
    if stored == "nvfp4_ds_mla_b12x":  # the b12x record: 16 B more, RoPE bf16 unless KV_FP8_ROPE=1
        return lora // 2 + lora // 16 + 16 + (rope if kv_fp8_rope else 2 * rope)
    raise AssertionError(stored)


_DSA_GEOMETRY = (512, 64)  # the packed records' kernels are built for kv_lora_rank 512 + qk_rope_head_dim 64


def resolve_layout(engine: EngineVersion, family: str, asked: str, dcp: int, heads_per_rank: int,
                   kv_lora_rank: int, qk_rope: int, kv_fp8_rope: bool = False) -> KvLayout:
    """The layout the engine stores for `--kv-dtype asked` on `family`, or the EngineRefusal it makes."""
    who = f"{engine.label} on {family}"
    geometry = (kv_lora_rank, qk_rope)

    def layout(stored: str, backend: str, source: str) -> KvLayout:
        if stored.startswith("nvfp4") or stored == "fp8_ds_mla":
            if geometry != _DSA_GEOMETRY:
                raise EngineRefusal(f"{who}: the {stored} record is built for kv_lora_rank 512 + qk_rope_head_dim "
                                    f"64, this model has {kv_lora_rank} + {qk_rope}", "--kv-dtype auto or bf16")
        return KvLayout(asked, stored.replace("_b12x", ""), backend,
                        _latent(kv_lora_rank, qk_rope, stored, kv_fp8_rope), source)

    def refuse(reason: str, remedy: str) -> EngineRefusal:
        return EngineRefusal(f"{who}: {reason}", remedy)

    if engine.name == UPSTREAM:
        return _upstream(family, asked, dcp, heads_per_rank, layout, refuse)
    return _fork(engine, family, asked, layout, refuse)


_CANON = "model_executor/layers/attention/mla_attention.py: _canonicalize_sparse_mla_kv_cache_dtype"
_PRIORITIES = "platforms/cuda.py: _get_backend_priorities"


def _upstream(family, asked, dcp, heads_per_rank, layout, refuse) -> KvLayout:
    if asked == "nvfp4_ds_mla":
        if family != SM100:
            raise refuse("no sparse MLA backend serves nvfp4_ds_mla (FLASHMLA_SPARSE.supports_combination: SM100 "
                         "only)", "--kv-dtype fp8 (fp8_ds_mla, 656 B)")
        if dcp > 1:
            raise refuse("nvfp4_ds_mla with decode context parallelism is refused "
                         "(config/vllm.py: VllmConfig.validate_nvfp4_kv_cache_with_mla)",
                         "--dcp 1, or --kv-dtype fp8")
        return layout("nvfp4_ds_mla", "FLASHMLA_SPARSE", "v1/attention/backends/mla/flashmla_sparse.py (352 B "
                      "record); mla_attention.py: MLAAttention.get_kv_cache_spec")
    if family == SM120:
        if asked == "bf16":
            raise refuse("FLASHINFER_MLA_SPARSE_SM120, the only sparse backend there, takes no bf16 cache "
                         "(flashinfer_mla_sparse.py: FlashInferMLASparseSM120Backend.supports_combination)",
                         "--kv-dtype fp8 (fp8_ds_mla, 656 B)")
        if dcp > 1:
            raise refuse("FLASHINFER_MLA_SPARSE_SM120 has no decode context parallelism (its impl leaves "
                         "supports_dcp False; v1/attention/backend.py: validate_configuration, \"DCP not "
                         "supported\")", f"--dcp 1, or --engine {FORK} (serves DCP on sm_120)")
        return layout("fp8_ds_mla", "FLASHINFER_MLA_SPARSE_SM120", f"{_PRIORITIES}; {_CANON} (auto, fp8 -> "
                      "fp8_ds_mla)")
    if family == SM100:
        if asked == "auto":
            return layout("fp8_e4m3", "FLASHINFER_MLA_SPARSE", "model_executor/models/config.py: "
                          "GlmMoeDsaForCausalLM.verify_and_update_config (auto -> fp8_e4m3 on SM10x); "
                          f"{_PRIORITIES}")
        if asked == "fp8":
            return layout("fp8_e4m3", "FLASHINFER_MLA_SPARSE", f"{_PRIORITIES} (FlashInfer first for a "
                          "quantized cache; it refuses fp8_ds_mla)")
        if asked == "fp8_ds_mla":
            _fp8_dcp(family, dcp, heads_per_rank, refuse)
            return layout("fp8_ds_mla", "FLASHMLA_SPARSE", f"flashinfer_mla_sparse.py: supports_combination "
                          f"refuses fp8_ds_mla; {_CANON}")
        return layout("bf16", "FLASHMLA_SPARSE", _PRIORITIES)
    # sm_90
    if asked in ("auto", "bf16"):
        return layout("bf16", "FLASH_ATTN_MLA_SPARSE" if dcp == 1 else "FLASHMLA_SPARSE",
                      f"{_PRIORITIES} (FLASH_ATTN_MLA_SPARSE has no DCP: flashattn_mla_sparse.py)")
    _fp8_dcp(family, dcp, heads_per_rank, refuse)
    return layout("fp8_ds_mla", "FLASHMLA_SPARSE", f"{_CANON} (a quantized cache on FLASHMLA_SPARSE)")


MIN_HEADS_FOR_BF16_PREFILL = 32  # flashmla_sparse.py: the fp8 mixed-batch path below this many heads per rank


def _fp8_dcp(family, dcp, heads_per_rank, refuse) -> None:
    if dcp > 1 and heads_per_rank >= MIN_HEADS_FOR_BF16_PREFILL:
        raise refuse(f"FLASHMLA_SPARSE serves DCP on an fp8 cache only on its mixed-batch path (fewer than "
                     f"{MIN_HEADS_FOR_BF16_PREFILL} heads per rank; this TP leaves {heads_per_rank}: "
                     "flashmla_sparse.py: FlashMLASparseMetadataBuilder.__init__)",
                     "a higher --tp, --dcp 1, or --kv-dtype bf16")


def _fork(engine, family, asked, layout, refuse) -> KvLayout:
    b12x = engine.name == FORK_B12X
    if asked == "nvfp4_ds_mla":
        if b12x and family == SM120:
            return layout("nvfp4_ds_mla_b12x", "B12X_MLA_SPARSE", "v1/attention/backends/mla/b12x_mla_sparse.py: "
                          "B12xMLASparseBackend.customize_spec (432 B record, 368 B with KV_FP8_ROPE=1); "
                          f"{_CANON}")
        raise refuse("nvfp4_ds_mla is not a cache dtype this version serves here (only the b12x sparse backend "
                     "on sm_120 reads it)", "--kv-dtype fp8 (fp8_ds_mla, 656 B)"
                     + (f", or --engine {FORK_B12X} on sm_120" if family == SM120 else ""))
    if family == SM120:
        if asked in ("auto", "bf16"):
            if b12x:
                return layout("bf16", "B12X_MLA_SPARSE", f"b12x_mla_sparse.py: supported_kv_cache_dtypes; {_CANON} "
                              "(auto is not converted)")
            raise refuse("no sparse MLA backend stores a bf16 cache on sm_120 in this version",
                         "--kv-dtype fp8 (fp8_ds_mla, 656 B)")
        return layout("fp8_ds_mla", "B12X_MLA_SPARSE" if b12x else "the fork's sm_120 sparse MLA backend",
                      f"{_CANON} (a quantized cache -> fp8_ds_mla)")
    if family == SM100:
        if asked in ("auto", "bf16"):
            return layout("bf16", "FLASHMLA_SPARSE", f"{_PRIORITIES}; no auto -> fp8 switch in this version "
                          "(model_executor/models/config.py)")
        if asked == "fp8":
            return layout("fp8_e4m3", "FLASHINFER_MLA_SPARSE", f"{_PRIORITIES} (FlashInfer first for a quantized "
                          "cache)")
        return layout("fp8_ds_mla", "FLASHMLA_SPARSE", _CANON)
    if asked in ("auto", "bf16"):
        return layout("bf16", "FLASH_ATTN_MLA_SPARSE", _PRIORITIES)
    return layout("fp8_ds_mla", "FLASHMLA_SPARSE", f"{_CANON} (a quantized cache on FLASHMLA_SPARSE)")


# ---- the engine's defaults -----------------------------------------------------------------------------

def default_max_num_seqs(total_bytes: int) -> int:
    """`max_num_seqs` for the API server (engine/arg_utils.py: EngineArgs.get_batch_defaults): 1024 on GPUs of
    70 GiB or more, else 256."""
    return 1024 if total_bytes >= 70 * GIB else 256


def default_max_batched_tokens(total_bytes: int) -> int:
    """`max_num_batched_tokens` for the API server: 16384 at 160 GiB or more, 8192 at 70 GiB, else 2048."""
    if total_bytes >= 160 * GIB:
        return 16384
    return 8192 if total_bytes >= 70 * GIB else 2048


BLOCK_TOKENS = 64  # the sparse MLA backends' block: 64 tokens per rank, so 64 x DCP tokens of a sequence
GRANULE = 2 * MIB  # the extensible KV cache maps each layer segment in whole 2 MiB granules


def indexer_cache_layers(arch, engine: EngineVersion) -> int:
    """Decoder layers that hold an indexer cache: every layer in the fork; upstream, the layers that build an
    indexer (model_executor/models/utils.py: compute_skip_topk_layers: `indexer_types`, else a layer keeps its
    own top-k when max(layer - offset + 1, 0) % index_topk_freq == 0, offset `index_skip_topk_offset`, 2
    by default). Arithmetic, never a loop over num_hidden_layers."""
    if arch.index_head_dim is None:
        return 0
    if engine.indexer_every_layer:
        return arch.layers
    if arch.indexer_types is not None:
        return sum(t != "shared" for t in arch.indexer_types[:arch.layers])
    if arch.index_topk_pattern is not None:  # "S" marks a layer that reuses the previous top-k
        pattern = arch.index_topk_pattern[:arch.layers]
        return arch.layers - pattern.count("S")
    freq, offset, n = arch.index_topk_freq, arch.index_skip_topk_offset, arch.layers
    low = min(max(offset, 0), n)  # layers 0 .. offset-1: max(layer - offset + 1, 0) is 0, they keep one
    first, last = low - offset + 1, n - offset  # the value at the remaining layers runs over [first, last]
    return low + (last // freq - (first - 1) // freq if last >= first else 0)


def indexer_workspace(ctx: int, engine: EngineVersion) -> int:
    """The DSA indexer's prefill buffer: max_model_len x (576 x 2 // 132) x factor entries of 132 B, factor 5 up
    to 256k tokens, else 2 (v1/attention/backends/mla/indexer.py: get_max_prefill_buffer_size; config/vllm.py
    sets sparse_mla_prefill_workspace_factor); the fork adds a fixed 512 MiB."""
    factor = 5 if ctx <= 256 * 1024 else 2
    return ctx * (576 * 2 // 132) * factor * 132 + engine.indexer_workspace_fixed


__all__ = ["BLOCK_TOKENS", "DEFAULT_ENGINE", "ENGINES", "EngineRefusal", "EngineVersion", "FAMILIES", "GRANULE",
           "KV_DTYPES", "KvLayout", "SM100", "SM120", "SM90", "default_max_batched_tokens", "default_max_num_seqs",
           "engine_version", "family_name", "indexer_cache_layers", "indexer_workspace", "kv_dtype_name",
           "resolve_layout"]
