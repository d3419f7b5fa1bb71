"""Which tensors an engine slices by tensor parallelism, and how (docs/fit.md, "Sharding").

A table per engine maps a tensor name to the part of the model it belongs to and its parallel style:
replicated (every rank holds all of it), column (output features split), row (input features split), vocab
(rows of the vocabulary split, padded), or expert (routed experts: a rank-sliced checkpoint's rank segment,
or gate/up column and down row for unsliced experts). `slice_bytes` turns one tensor's header into the bytes
one rank allocates for it, for plain weights and for each field of an EXL3 linear.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from trellis_cli.errors import CheckFailed

REPLICATED, COLUMN, ROW, VOCAB, EXPERT = "replicated", "column", "row", "vocab", "expert"

PART_EXPERTS = "routed experts"
PART_SHARED = "shared expert"
PART_ATTENTION = "attention"
PART_INDEXER = "indexer"
PART_DENSE = "dense MLP"
PART_EMBED = "embeddings"
PART_HEAD = "lm_head"
PART_NORMS = "norms"
PART_ROUTER = "router"
PART_MTP = "MTP"
PART_OTHER = "other"
PARTS = (PART_EXPERTS, PART_SHARED, PART_ATTENTION, PART_INDEXER, PART_DENSE, PART_EMBED, PART_HEAD, PART_NORMS,
         PART_ROUTER, PART_MTP, PART_OTHER)

VOCAB_PADDING = 64  # vocabulary rows are padded to a multiple of 64 before they are split


class Rule(NamedTuple):
    pattern: re.Pattern
    part: str
    style: str


def _rule(pattern: str, part: str, style: str) -> Rule:
    return Rule(re.compile(pattern), part, style)


_MODULE = r"(?:\.|$)"  # the module name ends the match: `.weight`, `.trellis`, ... follow
# vLLM's GLM MoE DSA model (`GlmMoeDsaForCausalLM`, built on the DeepSeek-V2 model file: DeepseekV2MLAAttention,
# the DSA Indexer, DeepseekV2MoE, DeepseekV2MLP, VocabParallelEmbedding / ParallelLMHead) and its MTP layer
# (deepseek_mtp.py). First match wins; anything unmatched is replicated under "other".
VLLM_GLM_MOE_DSA: tuple[Rule, ...] = (
    _rule(r"\.mlp\.experts\.", PART_EXPERTS, EXPERT),
    _rule(r"\.mlp\.shared_experts\.(gate_proj|up_proj|gate_up_proj)" + _MODULE, PART_SHARED, COLUMN),
    _rule(r"\.mlp\.shared_experts\.down_proj" + _MODULE, PART_SHARED, ROW),
    _rule(r"\.mlp\.gate\.", PART_ROUTER, REPLICATED),  # router weight and e_score_correction_bias
    _rule(r"\.mlp\.(gate_proj|up_proj|gate_up_proj)" + _MODULE, PART_DENSE, COLUMN),
    _rule(r"\.mlp\.down_proj" + _MODULE, PART_DENSE, ROW),
    _rule(r"\.self_attn\.indexer\.", PART_INDEXER, REPLICATED),  # wq_b, wk, weights_proj, k_norm
    _rule(r"\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|fused_qkv_a_proj)" + _MODULE, PART_ATTENTION, REPLICATED),
    _rule(r"\.self_attn\.(q_proj|q_b_proj|kv_b_proj)" + _MODULE, PART_ATTENTION, COLUMN),
    _rule(r"\.self_attn\.o_proj" + _MODULE, PART_ATTENTION, ROW),
    _rule(r"\.self_attn\.(q_a_layernorm|kv_a_layernorm)" + _MODULE, PART_NORMS, REPLICATED),
    _rule(r"(layernorm|\.norm|enorm|hnorm)" + _MODULE, PART_NORMS, REPLICATED),
    _rule(r"embed_tokens" + _MODULE, PART_EMBED, VOCAB),
    _rule(r"(^lm_head|shared_head\.head)" + _MODULE, PART_HEAD, VOCAB),
    _rule(r"\.eh_proj" + _MODULE, PART_MTP, REPLICATED),  # MTP's nn.Linear(2H, H): not a parallel linear
)

ENGINES: dict[str, tuple[Rule, ...]] = {"vllm": VLLM_GLM_MOE_DSA}
ENGINE_SOURCES = {"vllm": "vLLM GlmMoeDsaForCausalLM (model_executor/models/deepseek_v2.py, deepseek_mtp.py)"}

_LAYER = re.compile(r"^model\.layers\.([0-9]+)\.")


MAX_LAYER_DIGITS = 12  # a layer number longer than this is damage, and past 4300 digits int() refuses it


def layer_of(name: str) -> int | None:
    m = _LAYER.match(name)
    if m is None:
        return None
    digits = m.group(1)
    if len(digits) > MAX_LAYER_DIGITS:
        raise CheckFailed(f"tensor {name[:40]!r}...: a layer number of {len(digits):,} digits; no model has that "
                          "many layers (a damaged header)")
    return int(digits)


def classify(rules: tuple[Rule, ...], name: str) -> tuple[str, str]:
    for rule in rules:
        if rule.pattern.search(name):
            return rule.part, rule.style
    return PART_OTHER, REPLICATED


# The EXL3 fields of a linear (docs/exl3-format.md): trellis [in/16, out/16, 16K], suh [in], svh [out],
# su/sv their packed-sign forms, mcg/mul1 scalar codebook markers.
_IN_SIDE, _OUT_SIDE = frozenset({"suh", "su"}), frozenset({"svh", "sv"})


WHOLE, SPLIT, PADDED = "whole", "split", "padded"


def split_of(name: str, shape: tuple[int, ...], style: str) -> tuple[str, int]:
    """How a rank holds this tensor under `style`: (WHOLE, 0), (SPLIT, length of the split dimension) or
    (PADDED, vocabulary rows, padded to VOCAB_PADDING before the split). EXPERT means an unsliced expert."""
    if style == REPLICATED or not shape:
        return WHOLE, 0
    field = name.rsplit(".", 1)[-1]
    if style == EXPERT:  # gate/up split their outputs, down its inputs (the loaders' cut of unsliced experts)
        style = ROW if ".down_proj." in name or ".w2." in name else COLUMN
    if style == VOCAB:
        return PADDED, shape[0]
    if field == "trellis" and len(shape) == 3:
        return SPLIT, shape[1] if style == COLUMN else shape[0]
    if field in _IN_SIDE:
        return (SPLIT, shape[0]) if style == ROW else (WHOLE, 0)
    if field in _OUT_SIDE or len(shape) == 1:  # svh; a bias splits with the outputs, whole when row-parallel
        return (SPLIT, shape[0]) if style == COLUMN else (WHOLE, 0)
    if field in ("mcg", "mul1"):
        return WHOLE, 0
    return SPLIT, shape[0] if style == COLUMN else shape[1]


def share(kind: str, length: int, nbytes: int, tp: int) -> int:
    """One rank's bytes of `nbytes` held as (kind, length) at `tp`: a split dimension is cut in ceil(length/tp)
    pieces (the last rank may hold padding); vocabulary rows are padded to a multiple of 64 first. `nbytes`
    may be the sum of several tensors with the same split length (each is a whole number of rows)."""
    if kind == WHOLE or length <= 0 or tp == 1 and kind == SPLIT:
        return nbytes
    if kind == PADDED:
        length, rows = length, -(-length // VOCAB_PADDING) * VOCAB_PADDING
        return nbytes // length * -(-rows // tp)
    return nbytes // length * -(-length // tp)


def slice_bytes(name: str, shape: tuple[int, ...], nbytes: int, style: str, tp: int) -> int:
    """The bytes one of `tp` ranks allocates for this tensor under `style`."""
    return share(*split_of(name, shape, style), nbytes, tp)
