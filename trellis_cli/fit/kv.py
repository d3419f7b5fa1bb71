"""KV cache bytes per token and the engine's block arithmetic for MLA with the DSA indexer (docs/fit.md, "KV cache").

MLA caches one latent per token per layer in the layout the engine's backend picks on the GPU family
(engines.resolve_layout), the same on every TP rank (the latent is not split by heads); decode context
parallelism (DCP) spreads the tokens over `dcp` ranks. The engine allocates whole blocks of 64 tokens per rank
(64 x DCP tokens of a sequence), all layers' pages of a block together (GLM-5's latent and indexer caches form one
group), holds one null block back, and with the extensible cache maps each layer's segment in 2 MiB granules.
Never the `2 * layers * kv_heads * head_dim` of dense attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.fit.arch import Arch
from trellis_cli.fit.engines import (BLOCK_TOKENS, FP8_SCALE_BLOCK, GRANULE, EngineVersion, KvLayout,
                                     indexer_cache_layers)

NULL_BLOCKS = 1  # v1/core/block_pool.py: BlockPool.__init__ takes the first free block as the null block


def indexer_bytes(arch: Arch) -> int:
    """The DSA indexer's key per token on a layer with an indexer cache: fp8 key and its fp32 scale
    (deepseek_v2.py / deepseek_v32/attention.py: the indexer's k_cache head_dim = head_dim + head_dim // 128 * 4)."""
    if arch.index_head_dim is None:
        return 0
    return arch.index_head_dim + 4 * (arch.index_head_dim // FP8_SCALE_BLOCK)


def _granules(nbytes: int) -> int:
    return -(-nbytes // GRANULE) * GRANULE


@dataclass(frozen=True)
class KvPerToken:
    layout: KvLayout
    latent_per_layer: int  # bytes
    indexer_per_layer: int  # bytes, on layers that keep an indexer cache
    latent_layers: int  # decoder layers (+ MTP layers when loaded)
    indexer_layers: int
    dcp: int
    granular: bool = False  # the extensible cache: each layer's segment in whole 2 MiB granules

    @property
    def kv_dtype(self) -> str:
        return self.layout.stored

    @property
    def all_ranks_bytes(self) -> int:
        """One token, all layers, before DCP spreads it."""
        return self.latent_per_layer * self.latent_layers + self.indexer_per_layer * self.indexer_layers

    @property
    def rank_bytes(self) -> float:
        """One token, all layers, on one rank (`kv_bytes_per_token`)."""
        return self.all_ranks_bytes / self.dcp

    @property
    def block_bytes(self) -> int:
        """One block on one rank, all layers: the unit the engine divides its KV memory by."""
        return BLOCK_TOKENS * self.all_ranks_bytes

    @property
    def block_tokens(self) -> int:
        """Tokens of a sequence one block per rank holds (64 x DCP)."""
        return BLOCK_TOKENS * self.dcp

    def _mapped(self, blocks: int) -> int:
        """Bytes `blocks` blocks map per rank (granule rounding per layer segment with the extensible cache)."""
        if not self.granular:
            return blocks * self.block_bytes
        return (self.latent_layers * _granules(blocks * BLOCK_TOKENS * self.latent_per_layer)
                + self.indexer_layers * _granules(blocks * BLOCK_TOKENS * self.indexer_per_layer))

    def blocks(self, budget: int) -> int:
        """Blocks a per-rank budget holds (v1/core/kv_cache_planning.py: available_memory // bytes_per_block;
        with granules, the most whose mapped segments fit). A bounded search: about 64 steps."""
        if budget <= 0 or self.block_bytes <= 0:
            return 0
        high = budget // self.block_bytes
        if not self.granular:
            return high
        low = 0
        while low < high:  # the largest n <= high with _mapped(n) <= budget
            mid = (low + high + 1) // 2
            if self._mapped(mid) <= budget:
                low = mid
            else:
                high = mid - 1
        return low

    def tokens(self, budget: int) -> int:
        """Tokens of sequences the pool serves: its blocks less the null block, 64 x DCP tokens each."""
        return max(0, self.blocks(budget) - NULL_BLOCKS) * self.block_tokens

    def blocks_for(self, tokens: int) -> int:
        """Blocks per rank one `tokens`-token request needs (FullAttentionSpec.max_memory_usage_bytes:
        cdiv(cdiv(tokens, dcp), block_size))."""
        return -(-(-(-tokens // self.dcp)) // BLOCK_TOKENS)

    def bytes_for(self, tokens: int) -> int:
        """Per-rank bytes the engine's check demands for one `tokens`-token request, plus the null block."""
        return self._mapped(self.blocks_for(tokens) + NULL_BLOCKS)

    def engine_needs(self, tokens: int) -> int:
        """What `_check_enough_kv_cache_memory` (v1/core/kv_cache_planning.py) compares with the available
        memory: the request's blocks times the bytes per block, nothing else."""
        return self.blocks_for(tokens) * self.block_bytes

    def estimated_max_len(self, budget: int) -> int:
        """The engine's "estimated maximum model length" for a budget (estimate_max_model_len: the longest
        length whose blocks fit, the null block not counted)."""
        if budget <= 0 or self.block_bytes <= 0:
            return 0
        return budget // self.block_bytes * self.block_tokens


def kv_per_token(arch: Arch, layout: KvLayout, dcp: int, mtp: bool, engine: EngineVersion) -> KvPerToken:
    layers = arch.layers + (arch.mtp_layers if mtp else 0)
    # An MTP layer is a full decoder layer with its own indexer (deepseek_v32/attention.py: is_mtp_layer).
    indexed = indexer_cache_layers(arch, engine)
    indexed += arch.mtp_layers if mtp and arch.index_head_dim is not None else 0
    return KvPerToken(layout, layout.latent_bytes, indexer_bytes(arch), layers, indexed, dcp,
                      granular=engine.extensible_kv_cache)


__all__ = ["KvPerToken", "NULL_BLOCKS", "indexer_bytes", "kv_per_token"]
