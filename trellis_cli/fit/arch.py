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
# Fields without which the engine builds no model (a zero here is a named error, never a verdict).
AT_LEAST_ONE = ("hidden_size", "num_hidden_layers", "kv_lora_rank", "num_attention_heads", "vocab_size",
                "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "v_head_dim")
MAX_FIELD = 1 << 48  # larger than any model; past it a field is damage, not a model
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
    index_skip_topk_offset: int = 2  # compute_skip_topk_layers' default offset
    index_topk_pattern: str | None = None  # "S" at a layer that reuses the previous layer's top-k

    @property
    def latent_elements(self) -> int:
        return self.kv_lora_rank + self.qk_rope


def _short(value: Any) -> str:
    """A config value for a message: a huge integer by its digit count, never converted to text whole."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive(config: dict, key: str, file: str, default: Any = ...) -> Any:
    value = config.get(key, default)
    if value is ... or value is None:
        if default is ...:
            raise CheckFailed(f"{file}: {key} is missing; fit needs the model's {key} (MLA / DSA geometry)")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckFailed(f"{file}: {key} is {_short(value)}, expected a non-negative integer")
    if value > MAX_FIELD:
        raise CheckFailed(f"{file}: {key} is {_short(value)}, more than {MAX_FIELD:,}: not a model's {key}")
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
    for key in AT_LEAST_ONE:
        if get[key] < 1:
            raise CheckFailed(f"{file}: {key} is {get[key]}; the engine cannot build a model with none "
                              f"(fit needs at least 1)")
    if get["num_experts_per_tok"] > get["n_routed_experts"]:
        raise CheckFailed(f"{file}: num_experts_per_tok {get['num_experts_per_tok']} is more than n_routed_experts "
                          f"{get['n_routed_experts']}; the router cannot pick that many")
    max_positions = _positive(config, "max_position_embeddings", file, None)
    if max_positions == 0:
        raise CheckFailed(f"{file}: max_position_embeddings is 0; the engine derives max_model_len from it")
    types = config.get("indexer_types")
    if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
        raise CheckFailed(f"{file}: indexer_types is {types!r}, expected a list of \"full\" / \"shared\"")
    freq = _positive(config, "index_topk_freq", file, 1)
    if freq < 1:
        raise CheckFailed(f"{file}: index_topk_freq is {freq}, expected at least 1")
    if types is not None and len(types) != get["num_hidden_layers"]:
        raise CheckFailed(f"{file}: indexer_types has {len(types)} entries for {get['num_hidden_layers']} layers; "
                          "the engine needs one per hidden layer")
    if types is not None and set(types) - {"full", "shared"}:
        raise CheckFailed(f"{file}: indexer_types holds {sorted(set(types) - {'full', 'shared'})}; the engine "
                          "knows \"full\" and \"shared\"")
    offset = config.get("index_skip_topk_offset", 2)
    if not isinstance(offset, int) or isinstance(offset, bool) or abs(offset) > MAX_FIELD:
        raise CheckFailed(f"{file}: index_skip_topk_offset is {offset!r}, expected an integer")
    pattern = config.get("index_topk_pattern")
    if pattern is not None and not isinstance(pattern, str):
        if isinstance(pattern, list) and all(isinstance(p, str) for p in pattern):
            pattern = "".join("S" if p == "S" else "F" for p in pattern)
        else:
            raise CheckFailed(f"{file}: index_topk_pattern is {pattern!r}, expected a string of layer marks")
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
        max_positions=max_positions, index_skip_topk_offset=offset, index_topk_pattern=pattern)
