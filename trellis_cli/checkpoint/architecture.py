"""The weights an engine's model class loads for a checkpoint's architecture, from config.json alone.

GLM MoE DSA (`model_type` glm_moe_dsa: GLM-5 / 5.2) and the DeepSeek-V3 family it is built on, as vLLM's model
file builds them: `vllm/model_executor/models/deepseek_v2.py` (read in the vLLM 0.34.0 wheel; the fork serves
GLM-5 through this file): `DeepseekV2Model` (embed_tokens, layers, norm), `DeepseekV2ForCausalLM` (lm_head),
`DeepseekV2DecoderLayer` (input/post-attention RMSNorm; a MoE layer from `first_k_dense_replace` on where
`layer % moe_layer_freq == 0`, else `DeepseekV2MLP`), `DeepseekV2MLAAttention` (q_a_proj + q_a_layernorm + q_b_proj
with a q_lora_rank, else q_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj), `Indexer` (wq_b; wk and
weights_proj fused unquantized; k_norm a LayerNorm with bias) on the layers whose `index_topk_freq` /
`index_skip_topk_offset` / `index_topk_pattern` schedule builds one, `DeepseekV2MoE` (the router `GateLinear`, its
`e_score_correction_bias` when `topk_method` is noaux_tc, `n_shared_experts` shared experts as one MLP). The MTP
layers (`deepseek_mtp.py`, `DeepSeekMultiTokenPredictorLayer`: enorm, hnorm, eh_proj, shared_head.norm and a full
decoder block, always with an indexer) are loaded only by the MTP draft model (speculative decoding), so they are
listed apart. Routed experts are not listed here: the expert rules check them.

Shapes are the checkpoint's (`[out, in]` for a linear). A linear the model class may quantize can instead be stored
as an EXL3 linear (`.trellis` `[in/16, out/16, 16K]`, padded to 128 at most); what it allocates unquantized
(norms, the router, the indexer's wk / weights_proj, eh_proj, the embedding) must be a float `.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

# model_type -> the model class that builds it (all from deepseek_v2.py)
MODEL_CLASSES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                 "deepseek_v32": "DeepseekV32ForCausalLM"}
MODEL_FILE = "vllm/model_executor/models/deepseek_v2.py (DeepseekV2ForCausalLM), MTP: deepseek_mtp.py"

WEIGHT = ".weight"
LINEAR = "linear"  # float .weight, or an EXL3 linear under the same prefix
PLAIN = "plain"  # float only: allocated unquantized by the model class
FLOAT_DTYPES = frozenset({"BF16", "F16", "F32"})
REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "kv_lora_rank",
                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "moe_intermediate_size", "n_routed_experts")


class Weight(NamedTuple):
    name: str  # the checkpoint name: `model.layers.3.self_attn.o_proj.weight`
    shape: tuple[int, ...]
    kind: str  # LINEAR or PLAIN
    dtype: str | None = None  # a required dtype; None: any float dtype (the loader casts)

    @property
    def prefix(self) -> str:
        return self.name.rsplit(".", 1)[0]


@dataclass
class ModelWeights:
    model_class: str
    main: list[Weight] = field(default_factory=list)  # what the main model loads
    mtp: dict[int, list[Weight]] = field(default_factory=dict)  # MTP layer -> what the MTP draft model loads


class ConfigProblem(ValueError):
    """config.json cannot describe the model class (a field missing or malformed): said by name."""


def _int(config: dict, key: str, default: Any = ...) -> Any:
    value = config.get(key, default)
    if value is ...:
        raise ConfigProblem(f"config.json: {key} is missing (the model class needs it)")
    if value is None and default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigProblem(f"config.json: {key} is {value!r}, expected a non-negative integer")
    return value


def model_class(config: dict) -> str | None:
    """The model class whose weights are listed for this config, None for an architecture not listed here."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return MODEL_CLASSES.get(model_type) if isinstance(model_type, str) else None


def builds_indexer(config: dict, layer: int) -> bool:
    """Whether DeepseekV2MLAAttention builds an Indexer on `layer` (its `_skip_topk`; MTP layers always)."""
    if "index_topk" not in config:
        return False
    if layer >= _int(config, "num_hidden_layers"):
        return True
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return not (0 <= layer < len(pattern) and pattern[layer] == "S")
    freq = _int(config, "index_topk_freq", 1) or 1
    offset = _int(config, "index_skip_topk_offset", 2)
    return max(layer - offset + 1, 0) % freq == 0


def model_weights(config: dict) -> ModelWeights | None:
    """Every non-routed-expert weight the model class loads; None for an architecture not listed here.
    Raises ConfigProblem for a config.json that cannot build the model."""
    name = model_class(config)
    if name is None:
        return None
    for key in REQUIRED_FIELDS:
        _int(config, key)
    layers = _int(config, "num_hidden_layers")
    out = ModelWeights(name)
    for layer in range(layers):
        out.main += _layer(config, layer, mtp=False)
    h, vocab = _int(config, "hidden_size"), _int(config, "vocab_size")
    out.main += [Weight("model.embed_tokens.weight", (vocab, h), PLAIN), Weight("model.norm.weight", (h,), PLAIN),
                 Weight("lm_head.weight", (vocab, h), LINEAR)]
    for layer in range(layers, layers + (_int(config, "num_nextn_predict_layers", 0) or 0)):
        p = f"model.layers.{layer}."
        out.mtp[layer] = _layer(config, layer, mtp=True) + [
            Weight(p + "enorm" + WEIGHT, (h,), PLAIN), Weight(p + "hnorm" + WEIGHT, (h,), PLAIN),
            Weight(p + "eh_proj.weight", (h, 2 * h), PLAIN), Weight(p + "shared_head.norm.weight", (h,), PLAIN)]
    return out


def _layer(config: dict, layer: int, mtp: bool) -> list[Weight]:
    h = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    nope, rope, v = _int(config, "qk_nope_head_dim"), _int(config, "qk_rope_head_dim"), _int(config, "v_head_dim")
    kv_lora, q_lora = _int(config, "kv_lora_rank"), _int(config, "q_lora_rank", None)
    p = f"model.layers.{layer}."
    a = p + "self_attn."
    rows = [Weight(p + "input_layernorm.weight", (h,), PLAIN), Weight(p + "post_attention_layernorm.weight", (h,), PLAIN)]
    if q_lora:
        rows += [Weight(a + "q_a_proj.weight", (q_lora, h), LINEAR), Weight(a + "q_a_layernorm.weight", (q_lora,), PLAIN),
                 Weight(a + "q_b_proj.weight", (heads * (nope + rope), q_lora), LINEAR)]
    else:
        rows.append(Weight(a + "q_proj.weight", (heads * (nope + rope), h), LINEAR))
    rows += [Weight(a + "kv_a_proj_with_mqa.weight", (kv_lora + rope, h), LINEAR),
             Weight(a + "kv_a_layernorm.weight", (kv_lora,), PLAIN),
             Weight(a + "kv_b_proj.weight", (heads * (nope + v), kv_lora), LINEAR),
             Weight(a + "o_proj.weight", (h, heads * v), LINEAR)]
    if builds_indexer(config, layer):
        ix = a + "indexer."
        n, d = _int(config, "index_n_heads"), _int(config, "index_head_dim")
        rows += [Weight(ix + "wq_b.weight", (n * d, q_lora or h), LINEAR), Weight(ix + "wk" + WEIGHT, (d, h), PLAIN),
                 Weight(ix + "weights_proj.weight", (n, h), PLAIN), Weight(ix + "k_norm.weight", (d,), PLAIN),
                 Weight(ix + "k_norm.bias", (d,), PLAIN)]
    freq = _int(config, "moe_layer_freq", 1) or 1
    if layer >= _int(config, "first_k_dense_replace", 0) and layer % freq == 0:
        experts = _int(config, "n_routed_experts")
        m = p + "mlp."
        rows.append(Weight(m + "gate" + WEIGHT, (experts, h), PLAIN))
        if config.get("topk_method") == "noaux_tc":
            rows.append(Weight(m + "gate.e_score_correction_bias", (experts,), PLAIN))
        shared = (_int(config, "n_shared_experts", None) or 0) * _int(config, "moe_intermediate_size")
        if shared:
            rows += _mlp(m + "shared_experts.", h, shared)
    else:
        rows += _mlp(p + "mlp.", h, _int(config, "intermediate_size"))
    return rows


def _mlp(prefix: str, h: int, inner: int) -> list[Weight]:
    return [Weight(prefix + "gate_proj.weight", (inner, h), LINEAR), Weight(prefix + "up_proj.weight", (inner, h), LINEAR),
            Weight(prefix + "down_proj.weight", (h, inner), LINEAR)]


# ---- what a checkpoint stores for one expected weight ---------------------------------------------------------

def exl3_fits(weight: Weight, trellis_shape: tuple[int, ...]) -> bool:
    """An EXL3 linear `[in/16, out/16, 16K]` for `weight` (`[out, in]`); each side padded to 128 at most."""
    if weight.kind != LINEAR or len(weight.shape) != 2 or len(trellis_shape) != 3 or trellis_shape[2] % 16:
        return False
    out_f, in_f = weight.shape

    def fits(tiles: int, n: int) -> bool:
        return n <= 16 * tiles <= -(-n // 128) * 128

    return fits(trellis_shape[0], in_f) and fits(trellis_shape[1], out_f) and 1 <= trellis_shape[2] // 16 <= 8


def mismatch(weight: Weight, stored: Mapping[str, tuple[str, tuple[int, ...]]], any_dtype: bool = False) -> str | None:
    """None when `stored` (name -> (dtype, shape)) holds `weight` as the model class loads it; "missing" when
    nothing is there; else what the checkpoint holds instead, in words ("BF16 [64, 256]"). `any_dtype`: a
    loader with its own dense format (MXFP8) whose dtypes are not listed here: the shape alone is checked."""
    found = stored.get(weight.name)
    if found is None:
        trellis = stored.get(weight.prefix + ".trellis") if weight.kind == LINEAR else None
        if trellis is None:
            return "missing"
        dtype, shape = trellis
        if dtype == "I16" and exl3_fits(weight, shape):
            return None
        return f"an EXL3 linear {weight.prefix}.trellis {dtype} {list(shape)}"
    dtype, shape = found
    wanted = weight.dtype
    if tuple(shape) != weight.shape or (not any_dtype and (dtype != wanted if wanted else dtype not in FLOAT_DTYPES)):
        return f"{dtype} {list(shape)}"
    return None


def expected_form(weight: Weight, any_dtype: bool = False) -> str:
    """How the model class takes `weight`, in words: "a float .weight (BF16, F16 or F32) [512, 256], or an
    EXL3 linear .trellis I16 [16, 32, 16K]"."""
    dtypes = "any dtype" if any_dtype else weight.dtype or "BF16, F16 or F32"
    text = f"{list(weight.shape)} ({dtypes})"
    if weight.kind == LINEAR and len(weight.shape) == 2:
        text += f", or an EXL3 linear .trellis I16 [{-(-weight.shape[1] // 16)}, {-(-weight.shape[0] // 16)}, 16K]"
    return text


__all__ = ["ConfigProblem", "LINEAR", "MODEL_CLASSES", "MODEL_FILE", "ModelWeights", "PLAIN", "Weight",
           "builds_indexer", "exl3_fits", "expected_form", "mismatch", "model_class", "model_weights"]
