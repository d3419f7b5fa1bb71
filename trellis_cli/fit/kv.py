"""KV cache bytes per token for MLA with the DSA indexer (docs/fit.md, "KV cache").

MLA caches one latent per token per layer, `kv_lora_rank + qk_rope_head_dim` elements, the same on every TP
rank (the latent is not split by heads); decode context parallelism (DCP) spreads the tokens over `dcp`
ranks. Never the `2 * layers * kv_heads * head_dim` of dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.errors import UsageError
from trellis_cli.fit.arch import Arch

KV_DTYPES = ("auto", "bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla")
FP8_SCALE_BLOCK = 128  # fp8_ds_mla and the indexer key: one fp32 scale per 128 fp8 values
# nvfp4_ds_mla's bytes per token per layer for the 512 + 64 latent, as GLM-5.2 TP4 rigs report it; its layout
# is not in a source trellis could read, so other latent shapes are refused rather than guessed.
NVFP4_DS_MLA_BYTES = {(512, 64): 368}
BLOCK_TOKENS = 64  # MLA's KV block size: the pool is a whole number of blocks


def latent_bytes(arch: Arch, kv_dtype: str) -> int:
    """One layer's cached latent, one token, in `kv_dtype` ("auto" is the model dtype, bf16)."""
    lora, rope = arch.kv_lora_rank, arch.qk_rope
    if kv_dtype in ("auto", "bf16"):
        return 2 * (lora + rope)
    if kv_dtype == "fp8":
        return lora + rope
    if kv_dtype == "fp8_ds_mla":  # fp8 latent, an fp32 scale per 128 values, the RoPE part kept in bf16
        return lora + 4 * (lora // FP8_SCALE_BLOCK) + 2 * rope
    if kv_dtype == "nvfp4_ds_mla":
        if (lora, rope) not in NVFP4_DS_MLA_BYTES:
            raise UsageError(f"--kv-dtype nvfp4_ds_mla: its size is known for kv_lora_rank 512 + qk_rope_head_dim "
                             f"64 only, this model has {lora} + {rope}")
        return NVFP4_DS_MLA_BYTES[lora, rope]
    raise UsageError(f"--kv-dtype: unknown {kv_dtype!r} (known: {', '.join(KV_DTYPES)})")


def indexer_bytes(arch: Arch) -> int:
    """The DSA indexer's key per token on a layer with an indexer cache: fp8 key and its fp32 scale."""
    if arch.index_head_dim is None:
        return 0
    return arch.index_head_dim + 4 * (arch.index_head_dim // FP8_SCALE_BLOCK)


@dataclass(frozen=True)
class KvPerToken:
    kv_dtype: str
    latent_per_layer: int  # bytes
    indexer_per_layer: int  # bytes, on layers that keep an indexer cache
    latent_layers: int  # decoder layers (+ MTP layers when loaded)
    indexer_layers: int
    dcp: int

    @property
    def all_ranks_bytes(self) -> int:
        """One token, all layers, before DCP spreads it."""
        return self.latent_per_layer * self.latent_layers + self.indexer_per_layer * self.indexer_layers

    @property
    def rank_bytes(self) -> float:
        """One token, all layers, on one rank (`kv_bytes_per_token`)."""
        return self.all_ranks_bytes / self.dcp

    def tokens(self, budget: int) -> int:
        """Tokens a per-rank budget holds, in whole blocks (0 for a negative budget)."""
        if budget <= 0:
            return 0
        tokens = budget * self.dcp // self.all_ranks_bytes
        return tokens // BLOCK_TOKENS * BLOCK_TOKENS

    def bytes_for(self, tokens: int) -> int:
        """Per-rank bytes that `tokens` tokens need (rounded up to whole blocks)."""
        blocks = -(-tokens // BLOCK_TOKENS)
        return -(-blocks * BLOCK_TOKENS * self.all_ranks_bytes // self.dcp)


def kv_per_token(arch: Arch, kv_dtype: str, dcp: int, mtp: bool) -> KvPerToken:
    layers = arch.layers + (arch.mtp_layers if mtp else 0)
    # An MTP layer is a full decoder layer with its own indexer cache.
    indexed = arch.indexer_cache_layers()
    indexed += arch.mtp_layers if mtp and arch.index_head_dim is not None else 0
    return KvPerToken(kv_dtype, latent_bytes(arch, kv_dtype), indexer_bytes(arch), layers, indexed, dcp)
