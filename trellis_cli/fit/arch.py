"""The model facts fit needs from config.json: the GLM MoE DSA (`GlmMoeDsaConfig`) / DeepSeek-V3.2 fields.

MLA caches one latent per token per layer (`kv_lora_rank + qk_rope_head_dim` elements); the DSA indexer keeps
its own key (`index_head_dim`) on the layers that have an indexer cache; the MTP layers follow the main ones
(`num_nextn_predict_layers`, stored from layer `num_hidden_layers` on). A missing or malformed field is a
named error, never a guess: every KV number depends on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trellis_cli.errors import CheckFailed

REQUIRED = ("hidden_size", "num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
            "v_head_dim", "num_attention_heads", "vocab_size", "moe_intermediate_size", "n_routed_experts",
            "num_experts_per_tok")
# Architectures whose attention is MLA (the formula below); dense attention has another and is refused.
MLA_MODEL_TYPES = frozenset({"glm_moe_dsa", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite"})


@dataclass(frozen=True)
class Arch:
    model_type: str
    hidden: int
    layers: int  # decoder layers, MTP excluded
    mtp_layers: int
    first_dense: int  # first_k_dense_replace
    vocab: int
    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    moe_intermediate: int
    dense_intermediate: int | None
    experts: int
    top_k: int
    shared_experts: int
    index_head_dim: int | None  # None: no DSA indexer
    index_heads: int | None
    indexer_types: tuple[str, ...] | None  # GLM-5.3: "full" keeps an indexer cache, "shared" reuses one
    index_topk_freq: int
    max_positions: int | None

    @property
    def latent_elements(self) -> int:
        return self.kv_lora_rank + self.qk_rope

    def has_indexer_cache(self, layer: int) -> bool:
        """Whether decoder layer `layer` keeps its own indexer key cache."""
        if self.index_head_dim is None:
            return False
        if self.indexer_types is not None:
            return layer < len(self.indexer_types) and self.indexer_types[layer] != "shared"
        return layer % self.index_topk_freq == 0

    def indexer_cache_layers(self) -> int:
        """How many decoder layers keep an indexer cache (arithmetic, never a loop over num_hidden_layers)."""
        if self.index_head_dim is None:
            return 0
        if self.indexer_types is not None:
            return sum(t != "shared" for t in self.indexer_types[:self.layers])
        return -(-self.layers // self.index_topk_freq)


def _positive(config: dict, key: str, file: str, default: Any = ...) -> Any:
    value = config.get(key, default)
    if value is ... or value is None:
        if default is ...:
            raise CheckFailed(f"{file}: {key} is missing; fit needs the model's {key} (MLA / DSA geometry)")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckFailed(f"{file}: {key} is {value!r}, expected a non-negative integer")
    return value


# Model types whose memory fit does not price, by name, and why (docs/fit.md).
UNPRICED = {
    "glm5_next_text": "GLM-5.3-Flash (Glm5NextForConditionalGeneration): its hybrid linear attention keeps "
                      "per-sequence state on most layers and KV only on linear_attn_config.full_attn_layers; no "
                      "engine model file for it is profiled here, so fit refuses it rather than price it as GLM-5",
}


def _refuse_unpriced(config: dict, file: str) -> None:
    nested = config.get("text_config")
    for where, doc in (("model_type", config), ("text_config.model_type", nested if isinstance(nested, dict) else {})):
        kind = doc.get("model_type")
        if isinstance(kind, str) and kind in UNPRICED:
            raise CheckFailed(f"{file}: {where} {kind!r}: {UNPRICED[kind]}")


def read_arch(config: dict, file: str = "config.json") -> Arch:
    """The Arch of a config.json document; CheckFailed naming the field when one is missing or malformed."""
    if not config:
        raise CheckFailed(f"{file}: not present; fit needs the model config (MLA and indexer fields)")
    model_type = config.get("model_type")
    _refuse_unpriced(config, file)
    if not isinstance(model_type, str) or model_type not in MLA_MODEL_TYPES:
        raise CheckFailed(f"{file}: model_type {model_type!r}; fit knows the MLA architectures "
                          f"{', '.join(sorted(MLA_MODEL_TYPES))}")
    get = {key: _positive(config, key, file) for key in REQUIRED}
    types = config.get("indexer_types")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise CheckFailed(f"{file}: indexer_types is {types!r}, expected a list of \"full\" / \"shared\"")
    freq = _positive(config, "index_topk_freq", file, 1)
    if freq < 1:
        raise CheckFailed(f"{file}: index_topk_freq is {freq}, expected at least 1")
    return Arch(
        model_type=model_type, hidden=get["hidden_size"], layers=get["num_hidden_layers"],
        mtp_layers=_positive(config, "num_nextn_predict_layers", file, 0),
        first_dense=_positive(config, "first_k_dense_replace", file, 0), vocab=get["vocab_size"],
        heads=get["num_attention_heads"], q_lora_rank=_positive(config, "q_lora_rank", file, None),
        kv_lora_rank=get["kv_lora_rank"], qk_nope=get["qk_nope_head_dim"], qk_rope=get["qk_rope_head_dim"],
        v_head=get["v_head_dim"], moe_intermediate=get["moe_intermediate_size"],
        dense_intermediate=_positive(config, "intermediate_size", file, None), experts=get["n_routed_experts"],
        top_k=get["num_experts_per_tok"], shared_experts=_positive(config, "n_shared_experts", file, 0),
        index_head_dim=_positive(config, "index_head_dim", file, None),
        index_heads=_positive(config, "index_n_heads", file, None),
        indexer_types=tuple(types) if types is not None else None, index_topk_freq=freq,
        max_positions=_positive(config, "max_position_embeddings", file, None))
