"""The differential test of the loader profiles: small checkpoints built here, each with the verdict the named
loader version gives it and where in that version the verdict comes from (function, gist of its message).

A profile that drifts from its loader fails here. Each case runs `trellis validate --engine NAME [--tp N]`:
a refusal exits 1 with an error finding carrying the rule's code (and the engine's name where the rule is the
engine's own); a load exits 0. docs/engines.md has the same rules per profile, with their sources.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from corrupt import edit_json, rebuild_shard
from helpers import (add_protected, exl3v1_specs, run_cli, serve_exl3v1, tiny_checkpoint, to_plain_exl3, to_r7,
                     to_r7_v2)
from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

# The loader versions, as docs/engines.md names them.
V190 = "yatesdr/vllm-opt@1f0baf95 quantization/exl3.py (#190)"
VSHARED = "local-inference-lab/vllm quantization/exl3.py, stored version of 169,017 chars (shared-H)"
VR7 = "the fork's quantization/exl3.py, stored version of 212,886 chars (R7, GLM-5.3 scope)"
VMAN = "local-inference-lab/vllm@174fe4d quantization/exl3.py + utils/exl3.py, over b12x 1.5.1"
VB12X = "b12x 1.5.1 moe/checkpoints/exl3.py"
VEXL = "turboderp-org/exllamav3 v1.4.1 modules/linear.py"


class Case(NamedTuple):
    build: Callable[[Path], Path]
    engine: str
    tp: int | None
    code: str | None  # None: the loader loads it (exit 0); else the finding naming the rule that refuses it
    source: str  # the version, the function, and the gist of what it does there
    warning: str | None = None  # a warning the report must carry beside the verdict


# ---- builders ---------------------------------------------------------------------------------------------

def tr3(**changes) -> Callable[[Path], Path]:
    return lambda t: tiny_checkpoint(t, **changes)


def tr3_hybrid(changes: dict, **spec) -> Callable[[Path], Path]:
    def build(t: Path) -> Path:
        root = tiny_checkpoint(t, **spec)
        edit_json(root / "config.json", lambda c: _merge(c["hybrid_tr3_tail"], changes))
        return root
    return build


def tr3_without_quant_config(t: Path) -> Path:
    root = tiny_checkpoint(t)
    edit_json(root / "config.json", lambda c: c.pop("quantization_config"))
    return root


def r7(**kw) -> Callable[[Path], Path]:
    return lambda t: to_r7_v2(tiny_checkpoint(t, tp=1), **kw)


def r7_block(changes: dict) -> Callable[[Path], Path]:
    def build(t: Path) -> Path:
        root = to_r7_v2(tiny_checkpoint(t, tp=1))
        edit_json(root / "config.json", lambda c: c["quantization_config"]["r7_routed_experts"].update(changes))
        return root
    return build


def r7_stamped(stamp: str) -> Callable[[Path], Path]:
    def build(t: Path) -> Path:
        root = to_r7_v2(tiny_checkpoint(t, tp=1), embed=False)
        edit_json(root / "config.json", lambda c: c["quantization_config"].update(quant_method=stamp))
        return root
    return build


def r7_embedded_modelopt(t: Path) -> Path:
    root = to_r7_v2(tiny_checkpoint(t, tp=1))
    edit_json(root / "config.json", lambda c: c["quantization_config"].update(quant_method="modelopt"))
    return root


def r7_without_tensor_storage(t: Path) -> Path:
    root = to_r7_v2(tiny_checkpoint(t, tp=1))
    edit_json(root / "quantization_config.json", lambda q: q.update(tensor_storage={}))
    return root


def r7_without_down_svh(t: Path) -> Path:
    root = to_r7_v2(tiny_checkpoint(t, tp=1))
    rebuild_shard(root, "model-layer-003.safetensors",
                  lambda ts: ts.pop("model.layers.3.mlp.experts.r7_shared.down_svh"))
    return root


def r7_rank_sliced(t: Path) -> Path:
    root = to_r7(tiny_checkpoint(t, tp=1))  # v1 names: .rank0. segments, per-expert vectors
    edit_json(root / "config.json", lambda c: c["quantization_config"]["r7_routed_experts"].update(
        schema="r7-complete-v2-checkpoint-v1", codebook="mcg", moe_layers=[3, 4], k_values=[3, 4]))
    return root


def glm53_scope(t: Path, bits: int = 4) -> Path:
    """A GLM-5.3 unsliced stream: the tiny variant of `synth --preset glm53-tiny`, at K `bits`."""
    from trellis_cli.dialects.glm53.synth import preset, write_stream_checkpoint

    return write_stream_checkpoint(t / "stream", preset("glm53-tiny", bits=bits))


def glm53_release(k: int) -> Callable[[Path], Path]:
    return lambda t: glm53_scope(t, k)


def plain_stamped(stamp: str) -> Callable[[Path], Path]:
    def build(t: Path) -> Path:
        root = to_plain_exl3(tiny_checkpoint(t, tp=1, partition=None, uniform_k=4))
        edit_json(root / "config.json", lambda c: c["quantization_config"].update(quant_method=stamp))
        return root
    return build


def exl3v1(spec: str = "uniform-shared") -> Callable[[Path], Path]:
    def build(t: Path) -> Path:
        write_exl3v1_checkpoint(t / "x", exl3v1_specs()[spec])
        return t / "x"
    return build


def served(spec: str = "uniform-shared", *, barrier: bool = True, config: dict | None = None) -> Callable:
    def build(t: Path) -> Path:
        root = serve_exl3v1(exl3v1(spec)(t), barrier=barrier)
        if config is not None:
            edit_json(root / "config.json", lambda c: _merge(c, config))
        return root
    return build


def _merge(doc: dict, changes: dict) -> None:
    for k, v in changes.items():
        if v is None:
            doc.pop(k, None)
        elif isinstance(v, dict) and isinstance(doc.get(k), dict):
            _merge(doc[k], v)
        else:
            doc[k] = v


def protected(**kw) -> Callable[[Path], Path]:
    return lambda t: add_protected(tiny_checkpoint(t), **kw)


def protected_embedded(**kw) -> Callable[[Path], Path]:
    """A protected tensor whose tensor_storage is embedded in config.json's quantization_config too (what the
    #190 and R7 versions read through Exl3Config.from_config)."""
    def build(t: Path) -> Path:
        root = add_protected(tiny_checkpoint(t), **kw)
        storage = json.loads((root / "quantization_config.json").read_text())["tensor_storage"]
        edit_json(root / "config.json", lambda c: c["quantization_config"].update(tensor_storage=storage))
        return root
    return build


def protected_record_without_mcg(t: Path) -> Path:
    """lm_head protected, its .mcg in the shard but not in its tensor_storage record."""
    root = add_protected(tiny_checkpoint(t), prefix="lm_head")
    edit_json(root / "quantization_config.json",
              lambda q: q["tensor_storage"]["lm_head"]["stored_tensors"].pop("lm_head.mcg"))
    return root


def protected_stored_k6_declared_8(t: Path) -> Path:
    """A protected tensor stored at K6 whose policy and tensor_storage record both say 8 (shape and bits)."""
    root = add_protected(tiny_checkpoint(t), bits=6, declared=8)
    prefix = "model.layers.0.self_attn.q_proj"

    def record(q: dict) -> None:
        entry = q["tensor_storage"][prefix]
        entry["bits_per_weight"] = 8
        entry["stored_tensors"][f"{prefix}.trellis"]["shape"] = [16, 16, 128]
    edit_json(root / "quantization_config.json", record)
    return root


def uniform_k4_map_says(k: int) -> Callable[[Path], Path]:
    """Uniform K4 data, bits 4, and trellis_bits_by_layer saying K`k` for layer 3."""
    return tr3_hybrid({"trellis_bits_by_layer": {"3": k, "4": 4}}, partition=None, uniform_k=4)


def uniform_k4_bits_says(k: int) -> Callable[[Path], Path]:
    """Uniform K4 data and map, bits saying K`k`."""
    return tr3_hybrid({"bits": k, "trellis_bits_by_layer": {"3": 4, "4": 4}}, partition=None, uniform_k=4)


def r7_map_disagrees(t: Path) -> Path:
    """An R7 checkpoint whose bit map gives expert 0's gate_proj another K than its trellis shape."""
    root = to_r7_v2(tiny_checkpoint(t, tp=1))
    manifest = root / "r7-experts-layer-003.json"
    ks = json.loads(manifest.read_text())
    ks[0] = 5 if ks[0] != 5 else 3
    manifest.write_text(json.dumps(ks))
    return root


def r7_map_written(text: Callable[[list], str]) -> Callable[[Path], Path]:
    """An R7 checkpoint whose layer-3 bit map is rewritten as `text(the map it had)`."""
    def build(t: Path) -> Path:
        root = to_r7_v2(tiny_checkpoint(t, tp=1))
        manifest = root / "r7-experts-layer-003.json"
        manifest.write_text(text(json.loads(manifest.read_text())))
        return root
    return build


R7_MAP_TOO_LONG = r7_map_written(lambda ks: json.dumps(ks + [4]))
R7_MAP_K7 = r7_map_written(lambda ks: json.dumps([7] + ks[1:]))
R7_MAP_NOT_JSON = r7_map_written(lambda ks: json.dumps(ks)[:-1])


# ---- the cases, by class of issue 47 ------------------------------------------------------------------------

CASES: dict[str, Case] = {
    # 1. every profile gives its verdict on exl3-v1
    "exl3v1/190": Case(exl3v1(), "vllm-exl3-190", None, "engine.container",
                       f"{V190} override_quantization_method: claims only hybrid_tr3_tail; maybe_update_config reads "
                       "tensor_storage otherwise, which an exl3-v1 directory does not have"),
    "exl3v1/shared-h": Case(exl3v1(), "vllm-exl3-shared-h", None, "engine.container",
                            f"{VSHARED} override_quantization_method, _hydrate_tensor_storage: same two contracts"),
    "exl3v1/r7": Case(exl3v1(), "vllm-exl3-r7", None, "engine.container",
                      f"{VR7} override_quantization_method: r7_routed_experts, the GLM-5.3 scope or hybrid_tr3_tail"),
    "exl3v1/exllamav3": Case(exl3v1(), "exllamav3", None, "engine.container",
                             f"{VEXL} Linear.load_exl3: per-linear safetensors names, no manifest"),
    "exl3v1/b12x": Case(exl3v1("pair-per-expert"), "b12x-exl3-v1", None, None,
                        f"{VB12X} read_exl3_manifest / read_exl3_layer: per-expert pair rates are read"),
    "exl3v1/manifest": Case(served(), "vllm-exl3-manifest", 4, None,
                            f"{VMAN} Exl3Config.from_config, Exl3MoEMethod.process_weights_after_loading"),
    # 2. the TP the server runs
    "tr3-tp/190-differs": Case(tr3(), "vllm-exl3-190", 4, "engine.tp",
                               f"{V190} Exl3MoEMethod.create_weights: the recorded tp must equal the runtime TP"),
    "tr3-tp/190-equal": Case(tr3(), "vllm-exl3-190", 2, None, f"{V190} Exl3MoEMethod.create_weights"),
    "tr3-tp/shared-h-differs": Case(tr3(), "vllm-exl3-shared-h", 8, "engine.tp",
                                    f"{VSHARED} Exl3MoEMethod.create_weights: same hard contract"),
    "tr3-tp/shared-h-equal": Case(tr3(), "vllm-exl3-shared-h", 2, None, f"{VSHARED} Exl3MoEMethod.create_weights"),
    "r7-tp/unaligned": Case(r7(), "vllm-exl3-r7", 4, "engine.tp",
                            f"{VR7} Exl3MoEMethod.create_weights slices unsliced R7 experts per rank; "
                            "_validate_moe_shapes wants 128-aligned dimensions (256 / 4 = 64 is not)"),
    "r7-tp/aligned": Case(r7(), "vllm-exl3-r7", 2, None, f"{VR7} create_weights, _validate_moe_shapes"),
    "manifest-tp/1": Case(served(), "vllm-exl3-manifest", 1, "engine.tp",
                          f"{VMAN} plan_exl3_extent: TP 2..24 only"),
    "manifest-tp/empty-extent": Case(served(), "vllm-exl3-manifest", 5, "engine.tp",
                                     f"{VMAN} plan_exl3_extent gives a rank no block; b12x validate_extent refuses "
                                     "an empty extent"),
    "manifest-tp/no-barrier": Case(served(barrier=False), "vllm-exl3-manifest", 4, "engine.tp",
                                   f"{VMAN} plan_exl3_extent: exactly one barrier, at the halfway slot"),
    # 3. R7
    "r7/loads": Case(r7(), "vllm-exl3-r7", None, None, f"{VR7} Exl3Config.from_config, maybe_update_config"),
    "r7/k5-three-tiers": Case(lambda t: to_r7_v2(tiny_checkpoint(t, tp=1, partition=None, bitmap={
                                  3: (3, 4, 5, 3, 4, 5, 3, 4), 4: (5, 5, 4, 4, 3, 3, 5, 3)})), "vllm-exl3-r7", 2, None,
                              f"{VR7} Exl3Config.from_config: k_values within 3, 4, 5; "
                              "Exl3MoEMethod.process_weights_after_loading prepares two or three tiers"),
    "r7/k2": Case(r7(k_values=[2, 3, 4]), "vllm-exl3-r7", None, "engine.r7-k-values",
                  f"{VR7} Exl3Config.from_config: k_values outside 3, 4, 5 are unsupported"),
    "r7/k-strings": Case(r7_block({"k_values": ["3", "4"]}), "vllm-exl3-r7", None, "engine.r7-k-values",
                         f"{VR7} Exl3Config.from_config: k_values must be JSON integers"),
    "r7/undeclared-k": Case(r7(k_values=[3]), "vllm-exl3-r7", None, "engine.r7-undeclared-k",
                            f"{VR7} the R7 path reads K from each trellis shape; a K outside k_values is refused"),
    "r7/schema": Case(r7_block({"schema": "r7-complete-v1"}), "vllm-exl3-r7", None, "engine.r7-schema",
                      f"{VR7} Exl3Config.from_config: only the v2 checkpoint schema"),
    "r7/bits": Case(r7_block({"bits": "mixed"}), "vllm-exl3-r7", None, "engine.r7-bits",
                    f"{VR7} Exl3Config.from_config: codebook mcg and bits mixed_tensor"),
    "r7/layers": Case(r7_block({"moe_layers": ["3", "4"]}), "vllm-exl3-r7", None, "engine.r7-layers",
                      f"{VR7} Exl3Config.from_config: moe_layers two JSON integers"),
    "r7/layer-range": Case(r7_block({"moe_layers": [3, 3]}), "vllm-exl3-r7", None, "engine.r7-layer-range",
                           f"{VR7} Exl3MoEMethod.create_weights: R7 handling only inside moe_layers"),
    "r7/tensor-storage": Case(r7_without_tensor_storage, "vllm-exl3-r7", None, "engine.tensor-storage",
                              f"{VR7} maybe_update_config: a non-empty tensor_storage, else the load stops"),
    "r7/shared-vectors": Case(r7_without_down_svh, "vllm-exl3-r7", None, "engine.r7-shared",
                              f"{VR7} Exl3MoEMethod.process_weights_after_loading: the layer-shared vectors "
                              "are required parameters"),
    "r7/rank-names": Case(r7_rank_sliced, "vllm-exl3-r7", None, "engine.r7-rank-names",
                          f"{VR7} Exl3MoEParameter._slice_loaded_weight: experts are cut per rank while loading"),
    "glm53/architecture": Case(glm53_scope, "vllm-exl3-r7", 2, "engine.glm53-architecture",
                               f"{VR7} _configure_glm53_unsliced_routed_experts: exact text-model match"),
    "glm53/k6-release": Case(glm53_release(6), "vllm-exl3-r7", 2, "engine.glm53-scope",
                             f"{VR7} Exl3Config.from_config: bits == 4 exactly (GLM-5.3 metadata is unsupported)"),
    "glm53/k-slab": Case(glm53_release(8), "vllm-exl3-r7", 2, "engine.glm53-k",
                         f"{VR7} _prepare_rank_sliced_weights: the slab is [.., 16*4] (slab geometry mismatch)"),
    "glm53/layers": Case(glm53_scope, "vllm-exl3-r7", 2, "engine.glm53-layers",
                         f"{VR7} _configure_glm53_unsliced_routed_experts fixes moe_layers (3, 45)"),
    "glm53/pr766-tp": Case(glm53_scope, "vllm-exl3-pr766", 8, "engine.tp",
                           "PR #766 lifts the TP check; _validate_moe_shapes still wants I/TP in 128 blocks"),
    "glm53/tp": Case(glm53_scope, "vllm-exl3-r7", 4, "engine.tp",
                     f"{VR7} _configure_glm53_unsliced_routed_experts fixes tp 2; create_weights compares"),
    # 4. the mainline manifest loader
    "manifest/tr3": Case(tr3(), "vllm-exl3-manifest", None, "engine.container",
                         f"{VMAN} Exl3Config.from_config: an exl3-manifest.json container or nothing"),
    "manifest/r7": Case(r7(), "vllm-exl3-manifest", None, "engine.container", f"{VMAN} Exl3Config.from_config"),
    "manifest/no-config": Case(exl3v1(), "vllm-exl3-manifest", 2, "engine.quant-config",
                               f"{VMAN} override_quantization_method: needs quant_method exl3 in config.json"),
    "manifest/dense-format": Case(served(config={"quantization_config": {"dense_format": None}}),
                                  "vllm-exl3-manifest", 2, "engine.manifest-config",
                                  f"{VMAN} Exl3Config.from_config: MXFP8 dense weights declared"),
    "manifest/ignored-layers": Case(served(config={"quantization_config": {"ignored_layers": ["q_proj"]}}),
                                    "vllm-exl3-manifest", 2, "engine.manifest-config",
                                    f"{VMAN} Exl3Config.from_config: the BF16 layer list"),
    "manifest/geometry": Case(served(config={"n_routed_experts": 5}), "vllm-exl3-manifest", 2,
                              "engine.manifest-geometry",
                              f"{VMAN} Exl3MoEMethod.process_weights_after_loading: manifest geometry = model"),
    "manifest/per-expert-rates": Case(served("pair-per-expert"), "vllm-exl3-manifest", 2, "engine.manifest-rates",
                                      f"{VB12X} trellis_from_exl3: uniform rates only"),
    # 5. protected tensors
    "protected/shared-h": Case(protected(), "vllm-exl3-shared-h", 2, None,
                               f"{VSHARED} _parse_protected_tensor_policy, _validate_protected_tensor_storage"),
    "protected/190": Case(protected(), "vllm-exl3-190", 2, "engine.protected-unread",
                          f"{V190} maybe_update_config returns after hybrid_tr3_tail: no policy, no tensor_storage"),
    "protected/r7": Case(protected(), "vllm-exl3-r7", 2, "engine.protected-unread",
                         f"{VR7} maybe_update_config: the rank-sliced path reads no policy"),
    "protected/declared-bits": Case(protected(declared=8), "vllm-exl3-shared-h", 2, "config.protected-k",
                                    f"{VSHARED} _validate_protected_tensor_storage: stored bits = declared bits"),
    "protected/mul1": Case(protected(marker="mul1"), "vllm-exl3-shared-h", 2, "config.protected-marker",
                           f"{VSHARED} _validate_protected_tensor_storage: an MCG marker, never MUL1"),
    # issue 52: the record of lm_head lists no .mcg (the shard has one): the record is what this version reads
    "protected/shared-h-record-without-mcg": Case(protected_record_without_mcg, "vllm-exl3-shared-h", 2,
                                                  "config.protected-marker",
                                                  f"{VSHARED} _validate_protected_tensor_storage: the record's "
                                                  "stored_tensors must name the MCG marker (\"missing its MCG marker\")"),
    "protected/shared-h-stored-k6-declared-8": Case(protected_stored_k6_declared_8, "vllm-exl3-shared-h", 2, None,
                                                    f"{VSHARED} _validate_protected_tensor_storage compares the "
                                                    "declaration with the record only; _validate_loaded_tensors "
                                                    "takes any width 1..8 x 16", "config.protected-stored-k"),
    "protected/r7-embedded": Case(protected_embedded(), "vllm-exl3-r7", 2, None,
                                  f"{VR7} Exl3Config.from_config reads the embedded tensor_storage; "
                                  "codebook_for_prefix falls back to the record's marker outside moe_layers"),
    "protected/190-embedded-in-moe-layers": Case(protected_embedded(prefix="model.layers.3.self_attn.q_proj"),
                                                 "vllm-exl3-190", 2, None,
                                                 f"{V190} Exl3Config.from_config, get_quant_method: the embedded "
                                                 "record makes the linear EXL3; codebook_for_prefix: mcg inside "
                                                 "moe_layers"),
    "protected/190-embedded-lm-head": Case(protected_embedded(prefix="lm_head"), "vllm-exl3-190", 2,
                                           "engine.protected-codebook",
                                           f"{V190} codebook_for_prefix answers from moe_layers alone on a "
                                           "rank-sliced checkpoint: none for lm_head, so "
                                           "Exl3LinearMethod.process_weights_after_loading finds its .mcg an "
                                           "unexpected codebook"),
    "protected/shared-h-embedded": Case(protected_embedded(), "vllm-exl3-shared-h", 2, None,
                                        f"{VSHARED} _hydrate_tensor_storage keeps a non-empty embedded map"),
    # 6. quant_method stamps and missing configs
    "stamp/plain-modelopt": Case(plain_stamped("modelopt"), "vllm-exl3-190", None, "engine.quant-method",
                                 f"{V190} override_quantization_method claims only hybrid_tr3_tail: the stamp rules"),
    "stamp/r7-external-modelopt": Case(r7_stamped("modelopt"), "vllm-exl3-r7", None, "engine.quant-method",
                                       f"{VR7} override_quantization_method reads the embedded config only"),
    "stamp/r7-embedded-modelopt": Case(r7_embedded_modelopt, "vllm-exl3-r7", 2, None,
                                       f"{VR7} override_quantization_method claims an embedded R7 block first, "
                                       "whatever the stamp says"),
    "stamp/r7-external-exl3": Case(r7_stamped("exl3"), "vllm-exl3-r7", None, "engine.r7-external",
                                   f"{VR7} Exl3Config.from_config sees no r7_routed_experts in config.json"),
    "no-config/shared-h": Case(tr3_without_quant_config, "vllm-exl3-shared-h", None, "engine.quant-config",
                               "vLLM ModelConfig._verify_quantization: the method comes from config.json"),
    "no-config/190": Case(tr3_without_quant_config, "vllm-exl3-190", None, "engine.quant-config",
                          "vLLM ModelConfig._verify_quantization"),
    "no-config/r7": Case(tr3_without_quant_config, "vllm-exl3-r7", None, "engine.quant-config",
                         "vLLM ModelConfig._verify_quantization"),
    # 7. what the loaders take that a strict reading would refuse
    "int-spelling/190-tp": Case(tr3_hybrid({"tp": "2"}), "vllm-exl3-190", 2, None,
                                f"{V190} Exl3MoEMethod.create_weights reads tp with int()"),
    "int-spelling/r7-tp": Case(tr3_hybrid({"tp": "2", "experts_per_layer": "8"}), "vllm-exl3-r7", 2, None,
                               f"{VR7} _configure_rank_sliced and create_weights read with int()"),
    # issue 52: moe_layers spelled as strings crashed validate (a TypeError) instead of these verdicts
    "int-spelling/190-moe-layers": Case(tr3_hybrid({"moe_layers": ["3", "4"]}), "vllm-exl3-190", 2, None,
                                        f"{V190} _configure_rank_sliced reads moe_layers with int()"),
    "int-spelling/r7-moe-layers": Case(tr3_hybrid({"moe_layers": ["3", "4"]}), "vllm-exl3-r7", 2, None,
                                       f"{VR7} _configure_rank_sliced reads moe_layers with int()"),
    "int-spelling/shared-h-moe-layers": Case(tr3_hybrid({"moe_layers": ["3", "4"]}), "vllm-exl3-shared-h", 2,
                                             "engine.json-int", f"{VSHARED} _configure_rank_sliced: moe_layers "
                                             "must be two JSON integers"),
    "int-spelling/shared-h-tp": Case(tr3_hybrid({"tp": "2"}), "vllm-exl3-shared-h", 2, "engine.json-int",
                                     f"{VSHARED} _configure_rank_sliced: tp must be a positive JSON integer"),
    "int-spelling/shared-h-k-values": Case(tr3_hybrid({"k_values": ["3", "4"]}), "vllm-exl3-shared-h", 2, None,
                                           f"{VSHARED} _configure_rank_sliced reads k_values with int()"),
    "int-spelling/190-bits": Case(tr3_hybrid({"bits": "4", "trellis_bits_by_layer": None},
                                                               partition=None, uniform_k=4), "vllm-exl3-190", 2,
                                  None, f"{V190} _configure_rank_sliced reads a uniform bits with float()"),
    "int-spelling/shared-h-bits": Case(tr3_hybrid({"bits": "4", "trellis_bits_by_layer": None}, partition=None,
                                                  uniform_k=4),
                                       "vllm-exl3-shared-h", 2, "engine.json-int",
                                       f"{VSHARED} _normalize_rank_sliced_metadata derives no map from a string"),
    "bits-map/shared-h-without-bits": Case(tr3_hybrid({"bits": None, "trellis_bits_by_layer": {"3": 4, "4": 4}},
                                                   partition=None, uniform_k=4), "vllm-exl3-shared-h", 2, None,
                                        f"{VSHARED} _configure_rank_sliced: bits is not required; the map is read"),
    "bits-map/190-needs-bits": Case(tr3_hybrid({"bits": None, "trellis_bits_by_layer": {"3": 4, "4": 4}},
                                               partition=None, uniform_k=4), "vllm-exl3-190", 2,
                                    "engine.bits-required", f"{V190} _configure_rank_sliced: bits is required"),
    "bits-map/190-ignores": Case(tr3_hybrid({"trellis_bits_by_layer": {"3": 4, "4": 4}}),
                                 "vllm-exl3-190", 2, None,
                                 f"{V190} _configure_rank_sliced never reads trellis_bits_by_layer"),
    # issue 52: the #190 and R7 versions never read trellis_bits_by_layer: a map contradicting bits over data at
    # bits' K loads (a warning); the shared-H version reads the map and refuses the K4 data
    "bits-map/190-map-k5-over-k4": Case(uniform_k4_map_says(5), "vllm-exl3-190", 2, None,
                                        f"{V190} _configure_rank_sliced, rank_sliced_layer_bitrates: bits for every "
                                        "layer", "tensor.k-mismatch"),
    "bits-map/r7-map-k5-over-k4": Case(uniform_k4_map_says(5), "vllm-exl3-r7", 2, None,
                                       f"{VR7} _configure_rank_sliced, rank_sliced_layer_bitrates: bits for every "
                                       "layer", "tensor.k-mismatch"),
    "bits-map/shared-h-map-k5-over-k4": Case(uniform_k4_map_says(5), "vllm-exl3-shared-h", 2, "engine.bits-map-k",
                                             f"{VSHARED} _configure_rank_sliced, trellis_bitrates_for_layer: the "
                                             "map is the layer's K"),
    "bits-map/190-bits-k5-over-k4": Case(uniform_k4_bits_says(5), "vllm-exl3-190", 2, "engine.uniform-k",
                                         f"{V190} rank_sliced_layer_bitrates: K5 slabs for K4 data"),
    "bits-map/shared-h-bits-k5-over-k4": Case(uniform_k4_bits_says(5), "vllm-exl3-shared-h", 2, None,
                                              f"{VSHARED} _configure_rank_sliced reads the map, not bits",
                                              "config.tr3-bits-by-layer"),
    "r7/map-disagrees": Case(r7_map_disagrees, "vllm-exl3-r7", 2, None,
                             f"{VR7} Exl3MoEMethod.process_weights_after_loading: K from each trellis shape; the "
                             "bit maps are not read", "tensor.k-mismatch"),
    # issue 52: a malformed R7 bit map is no refusal either: no loader reads bit_map_manifests (a warning names it)
    "r7/map-length": Case(R7_MAP_TOO_LONG, "vllm-exl3-r7", 2, None,
                          f"{VR7} Exl3Config.from_config keeps r7_routed_experts as given, never opening "
                          "bit_map_manifests; Exl3MoEMethod._prepare_r7_graph_weights and _r7_projection_tiers take "
                          "K from each trellis shape", "bitmap.length"),
    "r7/map-k-value": Case(R7_MAP_K7, "vllm-exl3-r7", 2, None,
                           f"{VR7} Exl3MoEMethod._prepare_r7_graph_weights and _r7_projection_tiers check the "
                           "shapes' K against k_values, not the bit maps", "bitmap.k-value"),
    "r7/map-not-json": Case(R7_MAP_NOT_JSON, "vllm-exl3-r7", 2, None,
                            f"{VR7} Exl3Config.maybe_update_config opens quantization_config.json and the "
                            "bits_per_expert file only", "bitmap.unreadable"),
    "bits-map/shared-h-refuses": Case(tr3_hybrid({"trellis_bits_by_layer": {"3": 4, "4": 4}}),
                                      "vllm-exl3-shared-h", 2, "engine.bits-map",
                                      f"{VSHARED} _configure_rank_sliced: no trellis_bits_by_layer with bits mixed"),
}


def _validate(root: Path, case: Case, capsys) -> tuple[int, dict]:
    args = ["validate", str(root), "--engine", case.engine, "--json"]
    if case.tp is not None:
        args += ["--tp", str(case.tp)]
    code, out, _ = run_cli(capsys, *args)
    return code, json.loads(out)


@pytest.mark.parametrize("name", list(CASES))
def test_profile_gives_the_loader_versions_verdict(name, tmp_path, capsys):
    case = CASES[name]
    code, doc = _validate(case.build(tmp_path), case, capsys)
    verdict = next(v for v in doc["engines"] if v["name"] == case.engine)
    errors = {f["code"]: f.get("engine") for f in doc["findings"] if f["severity"] == "error"}
    assert verdict["enforced"] and verdict["tp"] == case.tp
    warnings = {f["code"] for f in doc["findings"] if f["severity"] == "warning"}
    assert case.warning is None or case.warning in warnings, (case.source, warnings)
    if case.code is None:
        assert code == 0 and verdict["loads"], (case.source, errors)
        assert case.tp is None or verdict["tp_accepted"] == "any" or case.tp in verdict["tp_accepted"]
    else:
        assert code == 1 and not verdict["loads"] and case.code in errors, (case.source, errors)
        if case.code.startswith("engine."):
            assert errors[case.code] == case.engine


def test_every_case_names_a_function_documented_in_engines_md():
    text = (Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
    for name, case in CASES.items():
        functions = re.findall(r"\b(?:[A-Z]\w+\.)?_?[a-z0-9]+(?:_[a-z0-9]+)+\b", case.source.split(":")[0])
        assert functions and all(f in text for f in functions), (name, functions)


def test_without_tp_each_engine_lists_the_degrees_it_accepts(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "validate", str(served()(tmp_path)))
    assert code == 0 and "vllm-exl3 (manifest rules) ✓ TP 2-4" in out.splitlines()[-1]
    code, out, _ = run_cli(capsys, "validate", str(served()(tmp_path / "b")), "--tp", "4", "--json")
    doc = json.loads(out)
    assert doc["context"]["tp"] == 4 and {v["name"]: v["tp_accepted"] for v in doc["engines"]}[
        "vllm-exl3-manifest"] == [2, 3, 4]


def test_tp_is_checked_under_the_default_engine_too(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path)
    code, out, _ = run_cli(capsys, "validate", str(root), "--tp", "4")
    assert code == 1 and "error[engine.tp] (vllm-exl3-shared-h)" in out
    assert out.strip().splitlines()[-1].startswith("loads on at TP 4: vllm-exl3 (shared-H rules) ✗ checkpoint TP 2")


def test_tp_must_be_positive(tmp_path, capsys):
    code, _, err = run_cli(capsys, "validate", str(tiny_checkpoint(tmp_path)), "--tp", "0")
    assert code == 2 and "--tp" in err


def test_inspect_at_tp_gives_each_ranks_share_and_the_k_map(tmp_path, capsys):
    """R7 experts are cut per rank at load: rank 0's share, sliced here with torch as the loader slices (trellis
    and intermediate-side vectors split, hidden-side and layer-shared vectors whole), equals inspect's figure."""
    from safetensors.torch import load_file

    root = to_r7_v2(tiny_checkpoint(tmp_path, tp=1))
    tp = 2
    code, out, _ = run_cli(capsys, "inspect", str(root), "--tp", str(tp), "--json")
    view = json.loads(out)["serve_tp"]
    for row in view["layers"]:
        tensors = load_file(str(root / f"model-layer-{row['layer']:03d}.safetensors"))
        expected, ks = 0, {}
        for name, t in tensors.items():
            if ".r7_shared." in name or name.endswith(".mcg"):
                expected += t.numel() * t.element_size()
                continue
            proj, field = name.split(".")[-2:]
            # trellis [in/16, out/16, 16K]: gate/up cut on the output (intermediate) axis, down on the input one;
            # the intermediate-side vector (gate/up svh, down suh) is cut too, the hidden-side one stays whole
            split = {("trellis", "down_proj"): 0, ("suh", "down_proj"): 0, ("trellis", "gate_proj"): 1,
                     ("trellis", "up_proj"): 1, ("svh", "gate_proj"): 0, ("svh", "up_proj"): 0}.get((field, proj))
            part = t if split is None else t.narrow(split, 0, t.shape[split] // tp)
            expected += part.numel() * part.element_size()
            if field == "trellis":
                ks.setdefault(proj, {}).setdefault(f"K{t.shape[-1] // 16}", 0)
                ks[proj][f"K{t.shape[-1] // 16}"] += 1
        assert row["bytes_per_rank"] == expected and row["projection_k"] == ks
    assert code == 0 and view["engines"]["vllm-exl3-r7"] == {"accepts": True, "reason": None}
    code, out, _ = run_cli(capsys, "inspect", str(root), "--tp", "4")
    assert code == 0 and "vllm-exl3-r7: refuses (intermediate 256 / TP 4 not 128-aligned)" in out


def test_r7_without_bit_maps_loads_as_the_r7_loader_reads_k_from_shapes(tmp_path, capsys):
    root = to_r7_v2(tiny_checkpoint(tmp_path, tp=1))
    edit_json(root / "config.json", lambda c: c["quantization_config"]["r7_routed_experts"].pop("bit_map_manifests"))
    code, doc = _validate(root, Case(lambda t: t, "vllm-exl3-r7", 2, None, ""), capsys)
    warned = {f["code"] for f in doc["findings"] if f["severity"] == "warning"}
    assert code == 0 and "bitmap.reference" in warned


@pytest.mark.parametrize("build, code, wrong", [(R7_MAP_TOO_LONG, "bitmap.length", "found 25"),
                                                (R7_MAP_K7, "bitmap.k-value", "found ['7']"),
                                                (R7_MAP_NOT_JSON, "bitmap.unreadable", "")])
def test_a_malformed_r7_bit_map_loads_on_r7_and_the_warning_names_the_file(build, code, wrong, tmp_path, capsys):
    """No loader reads the R7 bit maps: the verdict is "loads on R7", and the warning says which map is wrong."""
    root = build(tmp_path)
    code_, out, _ = run_cli(capsys, "validate", str(root), "--engine", "vllm-exl3-r7", "--tp", "2", "--json")
    doc = json.loads(out)
    verdict = next(v for v in doc["engines"] if v["name"] == "vllm-exl3-r7")
    assert code_ == 0 and verdict["loads"] and not [f for f in doc["findings"] if f["severity"] == "error"]
    warned = [f for f in doc["findings"] if f["code"] == code]
    assert len(warned) == 1 and warned[0]["severity"] == "warning"
    assert warned[0]["location"]["file"] == "r7-experts-layer-003.json"
    assert "does not read" in warned[0]["message"] or "no loader reads" in warned[0]["message"]
    code_, out, _ = run_cli(capsys, "validate", str(root), "--engine", "vllm-exl3-r7", "--tp", "2")
    assert code_ == 0 and code in out and "r7-experts-layer-003.json" in out and wrong in out
    assert "vllm-exl3 (R7 rules) ✓" in out.strip().splitlines()[-1]


def _planned_extents(num_slots: int, alignment: int, layer_position: int, tp: int) -> list[tuple[int, int]]:
    """(first slot, count) per rank as the mainline planner deals them (utils/exl3.py, written here from its
    description): each half of the slots in whole alignment blocks, the first half over ceil(tp/2) ranks and the
    second over the rest, earlier ranks of a half taking the remainder; ownership rotates by one rank per layer
    (two at TP 10)."""
    half = num_slots // 2
    groups = [(0, (tp + 1) // 2), (half, tp // 2)]
    shares: list[tuple[int, int]] = []
    for start, ranks in groups:
        blocks = half // alignment
        counts = [blocks // ranks + (1 if r < blocks % ranks else 0) for r in range(ranks)]
        offsets = [sum(counts[:r]) for r in range(ranks)]
        shares += [(start + alignment * o, alignment * c) for o, c in zip(offsets, counts)]
    shift = layer_position * (2 if tp == 10 else 1)
    return [shares[(rank - shift) % tp] for rank in range(tp)]


@pytest.mark.parametrize("spec", ["uniform-shared", "pair-per-expert"])
def test_manifest_tp_contract_agrees_with_b12x_extent_checks(spec, tmp_path, capsys):
    """The TP degrees the manifest profile accepts are those where every rank's planned extent passes b12x
    1.5.1's own Exl3Manifest.validate_extent (the real reader, installed here) within the planner's 2..24."""
    from b12x.moe.checkpoints.exl3 import read_exl3_manifest

    root = served(spec)(tmp_path)
    manifest = read_exl3_manifest(root)
    geometry, layout = manifest.geometry, manifest.layout
    expected = []
    for tp in range(1, 65):
        ok = 2 <= tp <= 24
        for position in range(len(geometry.moe_layer_indices)) if ok else ():
            for first, count in _planned_extents(geometry.num_slots, layout.extent_alignment_slots, position, tp):
                try:
                    manifest.validate_extent(first, count)
                except ValueError:
                    ok = False
        if ok:
            expected.append(tp)
    code, out, _ = run_cli(capsys, "validate", str(root), "--json")
    accepted = {v["name"]: v["tp_accepted"] for v in json.loads(out)["engines"]}["vllm-exl3-manifest"]
    assert expected and accepted == expected


def test_protected_tensors_are_checked_against_the_embedded_tensor_storage_first(tmp_path, capsys):
    """The shared-H loader takes config.json's tensor_storage when it has one: a record there that disagrees with
    the declared bits is its refusal even when quantization_config.json agrees."""
    root = add_protected(tiny_checkpoint(tmp_path))
    storage = json.loads((root / "quantization_config.json").read_text())["tensor_storage"]
    wrong = {k: dict(v, bits_per_weight=8) for k, v in storage.items()}
    edit_json(root / "config.json", lambda c: c["quantization_config"].update(tensor_storage=wrong))
    code, doc = _validate(root, Case(lambda t: t, "vllm-exl3-shared-h", 2, None, ""), capsys)
    assert code == 1 and "config.protected-k" in {f["code"] for f in doc["findings"] if f["severity"] == "error"}
