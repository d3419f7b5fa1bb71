"""Metadata rules every per-linear dialect shares: the model's config.json fields as the serving engine reads
them, and consistency between config.json's quantization_config and quantization_config.json.

A dialect's own declarations are its rules module's: the `hybrid_tr3_tail` contract and bitmaps in
dialects/tr3/rules.py, R7's maps in dialects/r7/rules.py, tensor_storage in dialects/exl3/rules.py. Tensor facts
are not consulted here (rules_tensors compares declarations with shapes), except which layers hold expert
tensors: checked against the model's layer count.
"""

from __future__ import annotations

from typing import Any, Iterator

from trellis_cli.dialects.interface import QUANT_CONFIG
from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.findings import MAX_MISSING_SHOWN, Finding, Location, error, error_summary, warning
from trellis_cli.header import is_int


def check_config(ckpt: Checkpoint) -> Iterator[Finding]:
    """What holds for every per-linear dialect: the model's own fields and the quantization configs' agreement.
    A dialect's own declarations (TR3's hybrid_tr3_tail, R7's maps, tensor_storage) are its rules module's."""
    yield from check_model_fields(ckpt)
    yield from _check_quant_configs(ckpt)


def _check_quant_configs(ckpt: Checkpoint) -> Iterator[Finding]:
    embedded = ckpt.config.get("quantization_config")
    if isinstance(embedded, dict) and embedded.get("quant_method") not in (None, "exl3"):
        yield warning("config.quant-method", Location(file="config.json", tensor="quantization_config.quant_method"),
                      "quant_method conflicts with the EXL3 tensors (a leftover from another quantizer?)",
                      expected="exl3", found=embedded.get("quant_method"))
    external = ckpt.quant_config
    if isinstance(embedded, dict) and isinstance(external, dict):
        yield from _check_quant_config_drift(embedded, external)


# ---- the two quantization configs: what vLLM serves when they disagree ----------------------------------

DRIFT_KEYS = ("quant_method", "bits", "codebook", "head_bits", "r7_routed_experts")


def _check_quant_config_drift(embedded: dict, external: dict) -> Iterator[Finding]:
    for key in DRIFT_KEYS:
        if key in embedded and key in external and embedded[key] != external[key]:
            yield warning("config.quant-config-drift", Location(file=QUANT_CONFIG, tensor=key),
                          "config.json's quantization_config and quantization_config.json disagree: vLLM takes "
                          "the embedded one and opens quantization_config.json only for tensor_storage, so "
                          "quantization_config.json's value is not what gets served",
                          expected=embedded[key], found=external[key])


# ---- the model's own config.json fields, as the serving engine reads them -----------------------------

# Positive integers the engine sizes the model by (GLM / DeepSeek names, as dialects/open.py reads them);
# `true` is not one, although Python's bool is an int.
MODEL_SIZE_FIELDS = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts", "num_local_experts",
                     "moe_num_experts", "num_experts_per_tok", "num_hidden_layers")
MTP_FIELD = "num_nextn_predict_layers"  # MTP layers follow the main ones: layer num_hidden_layers is the first
EXPERT_COUNT_FIELDS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def check_model_fields(ckpt: Checkpoint) -> Iterator[Finding]:
    """Types of the fields the engine reads, top-k against the expert count, layers against the layer count."""
    config = ckpt.config
    valid: dict[str, int] = {}
    for key in (*MODEL_SIZE_FIELDS, MTP_FIELD):
        if key not in config:
            continue
        value, low = config[key], 0 if key == MTP_FIELD else 1
        if is_int(value) and value >= low:
            valid[key] = value
        else:
            yield error("config.model-field", Location(file="config.json", tensor=key), "the serving engine needs "
                        f"an integer >= {low} here", expected=f"integer >= {low}",
                        found=f"{type(value).__name__} {_short(value)}")
    experts = next((valid[k] for k in EXPERT_COUNT_FIELDS if k in valid), ckpt.num_experts)
    top_k = valid.get("num_experts_per_tok")
    if top_k is not None and experts is not None and top_k > experts:
        yield error("config.top-k", Location(file="config.json", tensor="num_experts_per_tok"), "routes each token "
                    "to more experts than a layer has", expected=f"<= {experts}", found=top_k)
    if "num_hidden_layers" in valid:
        yield from _check_layer_count(ckpt, valid["num_hidden_layers"] + valid.get(MTP_FIELD, 0))


def _check_layer_count(ckpt: Checkpoint, layers: int) -> Iterator[Finding]:
    where = "num_hidden_layers" + (f" + {MTP_FIELD}" if MTP_FIELD in ckpt.config else "")
    beyond = [li for li, layer in ckpt.layers.items() if li >= layers and (layer.experts or layer.shared_h)]
    for li in beyond[:MAX_MISSING_SHOWN]:
        yield error("config.layer-count", Location(layer=li), f"the files hold expert tensors of a layer the model "
                    f"does not have ({where} is {layers})", expected=f"layer < {layers}", found=li)
    if len(beyond) > MAX_MISSING_SHOWN:
        yield error_summary("config.layer-count", Location(), len(beyond) - MAX_MISSING_SHOWN, f"layers beyond {where}",
                            expected=f"layer < {layers}", found=f"{len(beyond)} layers")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
