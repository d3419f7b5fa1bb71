"""The checks of the `vllm-exl3-r7` profile: the fork's loader version that reads R7 checkpoints
(`r7_routed_experts`, schema `r7-complete-v2-checkpoint-v1`) and the GLM-5.3 unsliced-stream scope, beside the
rank-sliced TR3 path of the #190 era (int() coercion) with shared-H layouts accepted.

What the version does, in short (docs/engines.md has the table with sources): it recognizes R7 only from
config.json's embedded quantization_config; the R7 block must declare the exact schema, codebook mcg, bits
mixed_tensor, moe_layers as two JSON integers and k_values as JSON integers within 3, 4, 5; R7 experts are
stored without rank segments and cut per rank while loading; the hidden-side vectors are layer-shared
(`experts.r7_shared.gate_up_suh`, `experts.r7_shared.down_svh`); tensor_storage is required as for plain EXL3.
"""

from __future__ import annotations

from typing import Any, Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import VLLM_R7
from trellis_cli.dialects.registry import dialect_of, scope_of
from trellis_cli.findings import Location
from trellis_cli.header import is_int
from trellis_cli.validate.engine_rules import Refusal, container_refusal, storage_refusals, uniform_k_190
from trellis_cli.validate.engine_stamps import STAMP, embedded, text_config

R7_SCHEMA = "r7-complete-v2-checkpoint-v1"
R7_K_VALUES = (3, 4, 5)
R7_SHARED = {"gate_up_suh": "hidden", "down_svh": "hidden"}  # the layer-shared vectors, each [hidden]
R7_AT = Location(file="config.json", tensor="quantization_config.r7_routed_experts")


def glm53_scope(ckpt: Checkpoint) -> bool:
    """Whether config.json's own quantization_config declares a loader scope (the GLM-5.3 stream's), the one this
    version reads."""
    scope = scope_of(ckpt)
    return scope is not None and scope[1] == "config.json"


def _r7(ckpt: Checkpoint) -> Any:
    q = embedded(ckpt)
    return None if q is None else q.get("r7_routed_experts")


def r7_container(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """This version reads hybrid_tr3_tail, r7_routed_experts, the GLM-5.3 scope and tensor_storage; not b12x's
    exl3-v1 container and not a route pack."""
    yield from container_refusal(ckpt, VLLM_R7)


def r7_detected(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """R7 is recognized from the embedded quantization_config alone; described only in quantization_config.json
    it is not seen: the stamp then picks the loader (modelopt: not this one), or, stamped exl3, the R7 block is
    never configured and the layer-shared vectors have no reader."""
    q = embedded(ckpt)
    if not dialect_of(ckpt).streamed_k_maps or q is None or _r7(ckpt) is not None:
        return
    stamp = q.get("quant_method")
    if stamp != "exl3":
        yield Refusal("engine.quant-method", f"stamped {stamp!r}, R7 only external", STAMP, "config.json's "
                      "quantization_config has no r7_routed_experts, so the EXL3 override does not claim the "
                      f"checkpoint and its stamp {stamp!r} chooses another loader; quantization_config.json is "
                      "not read for this", expected="r7_routed_experts in config.json", found=stamp)
    else:
        yield Refusal("engine.r7-external", "R7 described only externally", R7_AT, "r7_routed_experts is read "
                      "from config.json's quantization_config only; here it is only in quantization_config.json, so "
                      "the R7 path is never configured", expected="r7_routed_experts in config.json",
                      found="quantization_config.json only")


def r7_contract(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Exl3Config.from_config on the embedded R7 block: schema, codebook/bits, moe_layers, k_values."""
    r7 = _r7(ckpt)
    if r7 is None:
        return
    if not isinstance(r7, dict):
        yield Refusal("engine.r7-schema", "r7_routed_experts not an object", R7_AT, "must be a JSON object",
                      found=type(r7).__name__)
        return
    if r7.get("schema") != R7_SCHEMA:
        yield Refusal("engine.r7-schema", "unsupported R7 schema", R7_AT, "the R7 block must declare this exact "
                      "schema", expected=R7_SCHEMA, found=r7.get("schema"))
    if r7.get("codebook") != "mcg" or r7.get("bits") != "mixed_tensor":
        yield Refusal("engine.r7-bits", "R7 needs mcg and mixed_tensor", R7_AT, "codebook must be 'mcg' and bits "
                      "'mixed_tensor'", expected={"codebook": "mcg", "bits": "mixed_tensor"},
                      found={"codebook": r7.get("codebook"), "bits": r7.get("bits")})
    span = r7.get("moe_layers")
    if not (isinstance(span, list) and len(span) == 2 and all(is_int(v) for v in span) and 0 <= span[0] <= span[1]):
        yield Refusal("engine.r7-layers", "R7 moe_layers not [first, last]", R7_AT, "moe_layers must be two "
                      "non-negative JSON integers with last >= first", expected="[first, last]", found=span)
    ks = r7.get("k_values")
    if not isinstance(ks, list) or not ks or not all(is_int(k) for k in ks):
        yield Refusal("engine.r7-k-values", "R7 k_values not JSON integers", R7_AT, "k_values must be a non-empty "
                      "list of JSON integers (strings are not coerced)", expected="[3, 4, 5]", found=ks)
    elif set(ks) - set(R7_K_VALUES):
        yield Refusal("engine.r7-k-values", f"R7 K {sorted(set(ks) - set(R7_K_VALUES))} unsupported", R7_AT,
                      "R7 serves K3, K4 and K5 only (K2 is not accepted by this version)",
                      expected=list(R7_K_VALUES), found=ks)


def r7_span(ckpt: Checkpoint) -> range | None:
    r7 = _r7(ckpt)
    span = r7.get("moe_layers") if isinstance(r7, dict) else None
    if isinstance(span, list) and len(span) == 2 and all(is_int(v) for v in span) and 0 <= span[0] <= span[1]:
        return range(span[0], span[1] + 1)
    return None


def _scope_refusals(ckpt: Checkpoint, layers: list[int], part: str) -> Iterator[Refusal]:
    """The refusals the checkpoint's declared loader scope (the GLM-5.3 stream's: dialects/glm53/gate.py) gives
    for `part`, as this version's verdict reasons."""
    scope = scope_of(ckpt)
    if scope is None or (part == "external") == (scope[1] == "config.json"):
        return
    for r in scope[0].scope_refusals(ckpt, layers, part):
        yield Refusal(r.code, r.reason, r.where or Location(), r.message, r.expected, r.found)


def glm53_contract(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """The GLM-5.3 routed-only scope: Exl3Config.from_config's three exact keys (a K6, K8 or K2 release is refused
    by its bits), then _configure_glm53_unsliced_routed_experts' exact text-model architecture."""
    yield from _scope_refusals(ckpt, layers, "metadata")


def glm53_stream(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """What the scope's synthesized contract then asks of the tensors: full-width K4 experts under its schema for
    every expert of MoE layers 3..45, no rank segment (create_weights' slabs, process_weights_after_loading)."""
    yield from _scope_refusals(ckpt, layers, "tensors")


def glm53_external(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """The scope is read from config.json's quantization_config only: declared in quantization_config.json
    alone it is never seen, and the checkpoint goes the plain EXL3 way (which wants tensor_storage)."""
    yield from _scope_refusals(ckpt, layers, "external")


def pr766_container(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """PR #766 is profiled for the GLM-5.3 unsliced stream only: its code was not read, so trellis claims no
    verdict for other layouts through it."""
    if not glm53_scope(ckpt):
        yield Refusal("engine.container", "profiled for the GLM-5.3 stream only", Location(),
                      "PR #766 (open) is profiled for the glm53_routed_experts_only scope's relaxed TP only; for "
                      "other layouts use the vllm-exl3-r7 profile", expected="scope glm53_routed_experts_only",
                      found=ckpt.dialect)


def r7_tensor_storage(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Outside the rank-sliced path (R7, plain EXL3) tensor_storage is required; the GLM-5.3 scope's
    maybe_update_config returns after configuring its own contract and never reads it."""
    if dialect_of(ckpt).rank_sliced_contract(ckpt) is None and not glm53_scope(ckpt):
        yield from storage_refusals(ckpt)


def _r7_layers(ckpt: Checkpoint, layers: list[int]) -> list[int]:
    return [li for li in layers if li in ckpt.layers] if dialect_of(ckpt).streamed_k_maps else []


def r7_layer_range(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """R7 handling (layer-shared vectors, slicing while loading) applies inside moe_layers only."""
    span = r7_span(ckpt)
    if span is None:
        return
    outside = [li for li in _r7_layers(ckpt, layers) if li not in span and ckpt.layers[li].experts]
    if outside:
        yield Refusal("engine.r7-layer-range", f"{len(outside)} layer(s) outside R7 moe_layers", R7_AT,
                      "these layers hold R7 experts but lie outside moe_layers, where the loader does not read "
                      "the R7 layout", expected=f"{span.start}..{span.stop - 1}", found=outside[:8])


def r7_rank_free(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """R7 experts are stored whole and cut per TP rank at load: a `.rank{r}.` segment is not a name it loads."""
    sliced = [li for li in _r7_layers(ckpt, layers) if ckpt.layers[li].rank_sliced]
    if sliced:
        yield Refusal("engine.r7-rank-names", "rank-sliced R7 names", Location(layer=sliced[0]), "R7 expert "
                      "tensors must be rank-free (experts.{E}.{proj}.trellis): this version slices them per rank "
                      "while loading and finds no parameter for rank{r} names",
                      expected="experts.{E}.{proj}.trellis", found="experts.{E}.{proj}.rank{r}.trellis")


def r7_shared_vectors(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Each R7 layer holds one gate/up input vector and one down output vector, fp16 [hidden]."""
    span = r7_span(ckpt)
    for li in _r7_layers(ckpt, layers):
        if span is not None and li not in span:
            continue
        shared = ckpt.layers[li].r7_shared
        for name in R7_SHARED:
            ref = shared.get(name)
            where = Location(layer=li, tensor=f"model.layers.{li}.mlp.experts.r7_shared.{name}")
            if ref is None:
                yield Refusal("engine.r7-shared", f"r7_shared.{name} missing", where, "the layer-shared hidden-side "
                              "vector is missing: the loader keeps one per layer and has nothing to load into it")
            elif ref.dtype != "F16" or len(ref.shape) != 1 or (ckpt.hidden and ref.shape[0] != ckpt.hidden):
                yield Refusal("engine.r7-shared", f"r7_shared.{name} shape", Location(file=ref.file, layer=li,
                              tensor=ref.name), "a layer-shared vector is fp16 [hidden]",
                              expected=f"F16 [{ckpt.hidden}]", found=f"{ref.dtype} {list(ref.shape)}")


def r7_undeclared_k(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Every R7 tensor's K (from its trellis shape) is one the block declares."""
    r7 = _r7(ckpt)
    ks = r7.get("k_values") if isinstance(r7, dict) else None
    if not isinstance(ks, list) or not all(is_int(k) for k in ks):
        return
    for li in _r7_layers(ckpt, layers):
        found = sorted({lin.k for projs in ckpt.layers[li].experts.values() for by_rank in projs.values()
                        for lin in by_rank.values() if lin.k is not None} - set(ks))
        if found:
            yield Refusal("engine.r7-undeclared-k", f"undeclared K {found}", Location(layer=li), "tensors of this "
                          "layer are at a K the R7 block does not declare", expected=sorted(ks), found=found)


def uniform_k_r7(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Its rank-sliced TR3 path is the #190 one: a uniform bits is every layer's K, served at K3..K6."""
    if dialect_of(ckpt).rank_sliced_contract(ckpt) is not None:
        yield from uniform_k_190(ckpt, layers)
