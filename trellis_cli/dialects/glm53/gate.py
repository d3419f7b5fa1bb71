"""The gate the fork's R7-era loader version (`vllm-exl3-r7`) puts on a checkpoint declaring the GLM-5.3 unsliced
stream's scope in config.json: the scope's exact quantization keys and text-model architecture, then the tensors
the scope fixes (MoE layers, experts, K, no rank segment); a scope only quantization_config.json declares is
never seen. Asked through the Dialect (`scope_declared`, `scope_refusals`); validate's engine rules
(validate/engine_r7.py) turn each refusal into that loader's verdict.
"""

from __future__ import annotations

from typing import Any, Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.glm53.contract import (ARCHITECTURE, FIXED_BITS, FIXED_EXPERTS, FIXED_LAYERS, LINEAR_ATTN,
                                                QUANT_KEYS, SCOPE, TENSOR_SCHEMA, quant_block, text_config)
from trellis_cli.dialects.interface import ContainerRefusal
from trellis_cli.findings import Location


def _refusal(code: str, reason: str, where: Location, message: str, expected: Any = None,
             found: Any = None) -> ContainerRefusal:
    return ContainerRefusal(reason, message, expected=expected, found=found, code=code, where=where)


def _embedded(ckpt: Checkpoint) -> dict[str, Any] | None:
    q = ckpt.config.get("quantization_config")
    return q if isinstance(q, dict) else None


def scope_declared(ckpt: Checkpoint) -> str | None:
    """The file declaring the scope: config.json's embedded quantization_config first, else
    quantization_config.json; None when neither does."""
    return quant_block(ckpt.config, ckpt.quant_config)[1]


def metadata_refusals(ckpt: Checkpoint, layers: list[int]) -> Iterator[ContainerRefusal]:
    """The GLM-5.3 routed-only scope: Exl3Config.from_config's three exact keys (a K6, K8 or K2 release is refused
    by its bits), then _configure_glm53_unsliced_routed_experts' exact text-model architecture."""
    q = _embedded(ckpt) or {}
    for key, want in QUANT_KEYS.items():
        have = q.get(key)
        if have == want:
            continue
        release = f"a K{have} release" if key == "bits" and isinstance(have, (int, float)) and have == int(have) \
            else f"{key} {have!r}"
        yield _refusal("engine.glm53-scope", f"{release}: scope needs {key} {want!r}",
                      Location(file="config.json", tensor=f"quantization_config.{key}"),
                      f"Exl3Config.from_config: the GLM-5.3 routed-only scope requires {key} == {want!r} exactly "
                      "(\"GLM-5.3 routed-only EXL3 metadata is unsupported\")", expected=want, found=have)
    text = text_config(ckpt.config)
    nested = "text_config." if isinstance(ckpt.config.get("text_config"), dict) else ""
    wrong = {k: text.get(k) for k, v in ARCHITECTURE.items() if text.get(k) != v}
    if wrong:
        first = next(iter(wrong))
        yield _refusal("engine.glm53-architecture", f"not the GLM-5.3 architecture ({', '.join(list(wrong)[:3])})",
                      Location(file="config.json", tensor=f"{nested}{first}"), "_configure_glm53_unsliced_routed_"
                      f"experts compares {len(ARCHITECTURE)} text-model fields exactly (\"GLM-5.3 routed-only "
                      "EXL3 architecture mismatch\")", expected={k: ARCHITECTURE[k] for k in wrong},
                      found=dict(list(wrong.items())[:8]))
    linear = text.get("linear_attn_config")
    if not isinstance(linear, dict) or any(linear.get(k) != v for k, v in LINEAR_ATTN.items()):
        yield _refusal("engine.glm53-architecture", "linear_attn_config differs",
                      Location(file="config.json", tensor=f"{nested}linear_attn_config"),
                      "_configure_glm53_unsliced_routed_experts: linear_attn_config must be an object with these "
                      "values (\"GLM-5.3 routed-only EXL3 linear/sparse attention mismatch\")",
                      expected=LINEAR_ATTN, found=linear)


def tensor_refusals(ckpt: Checkpoint, layers: list[int]) -> Iterator[ContainerRefusal]:
    """What the scope's synthesized contract then asks of the tensors: full-width K4 experts under its schema for
    every expert of MoE layers 3..45, no rank segment (create_weights' slabs, process_weights_after_loading)."""
    first, last = FIXED_LAYERS
    where = Location(file="config.json", tensor="quantization_config.scope")
    present = [li for li in ckpt.layers if ckpt.layers[li].experts]
    missing = [li for li in range(first, last + 1) if li not in present]
    if missing:
        yield _refusal("engine.glm53-layers", f"MoE layer(s) {missing[:4]} absent", where,
                      f"the scope fixes moe_layers ({first}, {last}) (main layers 3..44 and the MTP layer 45); "
                      "process_weights_after_loading refuses a layer with missing expert tensors "
                      "(\"Missing EXL3 MoE tensors\")", expected=f"{first}..{last}", found=present[:8])
    for li in layers:
        moe = ckpt.layers.get(li)
        if moe is None or not first <= li <= last:
            continue
        if moe.rank_sliced:
            yield _refusal("engine.glm53-rank-names", "rank-sliced names", Location(layer=li), "the scope's tensor "
                          f"schema is {TENSOR_SCHEMA}: full-width experts, cut per rank at load",
                          expected=TENSOR_SCHEMA, found="experts.{E}.{proj}.rank{r}.{field}")
        ks = sorted({lin.k for projs in moe.experts.values() for by_rank in projs.values()
                     for lin in by_rank.values() if lin.k is not None})
        if ks and ks != [FIXED_BITS]:
            yield _refusal("engine.glm53-k", f"layer {li} at K{ks}, the scope serves K{FIXED_BITS}",
                          Location(layer=li), "the scope fixes bits 4: every expert's slab is [.., 16*4] "
                          "(\"rank-sliced EXL3 slab geometry mismatch\"; with expert parallelism the bitrates "
                          "are forced to K4 too)", expected=FIXED_BITS, found=ks)
    if ckpt.num_experts is not None and ckpt.num_experts != FIXED_EXPERTS:
        yield _refusal("engine.glm53-experts", f"{ckpt.num_experts} experts, the scope fixes {FIXED_EXPERTS}",
                      Location(file="config.json", tensor="text_config.n_routed_experts"), "create_weights: "
                      "experts_per_layer (288, fixed by the scope) must equal the model's expert count (\"rank-"
                      "sliced EXL3 expert count does not match the model\")", expected=FIXED_EXPERTS,
                      found=ckpt.num_experts)


def external_refusals(ckpt: Checkpoint, layers: list[int]) -> Iterator[ContainerRefusal]:
    """The scope is read from config.json's quantization_config only: declared in quantization_config.json
    alone it is never seen, and the checkpoint goes the plain EXL3 way (which wants tensor_storage)."""
    block, where = quant_block(ckpt.config, ckpt.quant_config)
    if block is not None and where != "config.json":
        yield _refusal("engine.glm53-external", "scope only in quantization_config.json",
                      Location(file="config.json", tensor="quantization_config.scope"), "override_quantization_"
                      "method and Exl3Config.from_config read the scope from config.json's quantization_config; "
                      "here it is only in quantization_config.json, so the GLM-5.3 contract is never configured",
                      expected=SCOPE, found=(ckpt.config.get("quantization_config") or {}).get("scope"))
