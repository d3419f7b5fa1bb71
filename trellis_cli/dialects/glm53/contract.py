"""The GLM-5.3-Flash routed-experts-only layout as the fork's R7-era loader defines it: the scope that names it,
the tensor schema, and the exact quantization keys and text-model architecture its gate compares.

Facts read from the fork's `quantization/exl3.py` of the R7 era (`Exl3Config.from_config`,
`_configure_glm53_unsliced_routed_experts`, `Exl3MoEMethod.create_weights`); docs/checkpoint-dialects.md and
docs/engines.md cite them. Plain data, torch-free.
"""

from __future__ import annotations

import re
from typing import Any

from trellis_cli.id_ranges import CANONICAL_ID

DIALECT_GLM53 = "glm53/unsliced_tp_stream"
SCOPE = "glm53_routed_experts_only"
SOURCE_LAYOUT = "unsliced_tp_stream"  # what the loader records for the layout (never read from the checkpoint)
# The loader's name template: full-width experts, no rank segment, under the multimodal wrapper's prefix.
TENSOR_SCHEMA = "model.language_model.layers.{L}.mlp.experts.{E}.{proj}.{trellis|suh|svh|mcg}"
PREFIX = "model.language_model.layers."
FIELDS = ("trellis", "suh", "svh", "mcg")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_ID = f"({CANONICAL_ID})"
EXPERT_NAME = re.compile(rf"^model\.language_model\.layers\.{_ID}\.mlp\.experts\.{_ID}\."
                         r"(gate_proj|up_proj|down_proj)\.([A-Za-z0-9_]+)$")
RANK_NAME = re.compile(rf"^model\.language_model\.layers\.{_ID}\.mlp\.experts\.{_ID}\."
                       rf"(gate_proj|up_proj|down_proj)\.rank{_ID}\.([A-Za-z0-9_]+)$")
# Anything under a routed-expert container, whatever follows (a name the schema does not spell).
UNDER_EXPERTS = re.compile(r"^model\.language_model\.layers\.([^.]+)\.mlp\.experts\.")

# Exl3Config.from_config: with the scope, these keys must equal exactly (Python ==, so 4.0 passes as 4).
QUANT_KEYS = {"bits": 4, "codebook": "mcg", "non_routed_dtype_policy": "official_source_native"}
# _configure_glm53_unsliced_routed_experts: text_config (or config.json itself) compared field by field.
ARCHITECTURE = {
    "model_type": "glm5_next_text", "num_hidden_layers": 45, "num_nextn_predict_layers": 1,
    "first_k_dense_replace": 3, "n_routed_experts": 288, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "mla_use_nope": True, "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048, "index_kpool": 4,
    "index_kpool_compress": True, "index_kpool_always_select_tail": True,
}
LINEAR_ATTN = {"num_heads": 64, "head_dim": 128, "short_conv_kernel_size": 4,
               "full_attn_layers": [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43]}
# What the loader then fixes itself (not read from the checkpoint): K4 mcg, 288 experts, MoE layers 3..45 (45
# is the MTP layer), TP 2 unless expert parallelism streams whole experts.
FIXED_BITS, FIXED_TP, FIXED_LAYERS, FIXED_EXPERTS = 4, 2, (3, 45), 288
SLICE_QUANTUM = 128  # each rank's intermediate slice: whole 128-channel Hadamard blocks (_validate_moe_shapes)

MARKER_FIELD = "mcg"


def quant_block(config: dict | None, quant_config: dict | None) -> tuple[dict | None, str | None]:
    """The quantization block declaring the scope and where it is: config.json's embedded one first (what the
    loader reads), else quantization_config.json."""
    embedded = (config or {}).get("quantization_config")
    if isinstance(embedded, dict) and embedded.get("scope") == SCOPE:
        return embedded, "config.json"
    if isinstance(quant_config, dict) and quant_config.get("scope") == SCOPE:
        return quant_config, "quantization_config.json"
    return None, None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: `text_config` where config.json nests one (the multimodal wrapper), else itself."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def moe_layers(text: dict) -> list[int] | None:
    """first_k_dense_replace .. num_hidden_layers + num_nextn_predict_layers - 1 (the MTP layers follow the main
    ones); None when a field is not a non-negative integer."""
    first, count, mtp = (text.get(k) for k in ("first_k_dense_replace", "num_hidden_layers",
                                               "num_nextn_predict_layers"))
    values: tuple[Any, ...] = (first, count, mtp if mtp is not None else 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        return None
    return list(range(values[0], values[1] + values[2]))


def expert_key(layer: int, expert: int, proj: str, field: str) -> str:
    return f"model.language_model.layers.{layer}.mlp.experts.{expert}.{proj}.{field}"


def linear_shapes(hidden: int, intermediate: int, proj: str, k: int) -> dict[str, tuple[int, ...]]:
    """Full-width shapes of one linear: gate/up read H and write I, down the reverse."""
    fan_in, fan_out = (hidden, intermediate) if proj != "down_proj" else (intermediate, hidden)
    return {"trellis": (fan_in // 16, fan_out // 16, 16 * k), "suh": (fan_in,), "svh": (fan_out,), "mcg": ()}


DTYPES = {"trellis": "I16", "suh": "F16", "svh": "F16", "mcg": "I32"}
