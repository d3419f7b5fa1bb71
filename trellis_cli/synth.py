"""Synthetic rank-sliced TR3 checkpoints at any geometry, written exactly in the TR3 dialect.

Owns `SynthSpec` (geometry, per-layer K per expert, codebook, rotation layout), its presets, and
`write_checkpoint`, which writes config.json (with the `hybrid_tr3_tail` contract), tier_bitmap.json, one
`model-layer-NNN.safetensors` per MoE layer, model.safetensors.index.json and MANIFEST.sha256.

Tensor data comes from a `TensorSource`: `RandomTensors` (seeded random codes - every int16 pattern is a
valid trellis code - with converter-like suh/svh) or any other source, such as the bundled sample's real
quantized experts. Data is generated one EXL3 linear at a time in header order, so peak memory is one
linear plus one shard header, whatever the layer size. `sparse=True` writes real headers over unwritten
data (files with holes) so production-size checkpoints take seconds. Output is staged in `OUT.partial`
and renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol

import torch

from trellis_cli.checkpoint.model import PROJECTIONS
# The hidden-side vector of each projection: gate/up read H (input side), down writes H (output side).
from trellis_cli.checkpoint.names import H_SIDE as HIDDEN_SIDE_FIELD
from trellis_cli.checkpoint.names import SHARED_H_TENSOR_SCHEMA, TENSOR_SCHEMA, expert_key, shard_name, shared_h_key
from trellis_cli.codebooks import MARKERS, MCG_MARKER
from trellis_cli.disk_space import require_free_space
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header_records import MAX_HEADER_TENSORS
from trellis_cli.integrity import write_manifest
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter

MCG_MARKER_VALUE = MCG_MARKER  # 0xCBAC1FED as int32
# codebook -> (marker field, int32 value); 3inst has no marker.
CODEBOOK_MARKERS = MARKERS
ROTATION_LAYOUTS = ("per_expert_v1", "shared_h_v1")
BITMAP_FIELDS = ("k", "bits_per_expert")
FORMAT = "exl3-trellis"
PRODUCER = "trellis synth"
NON_EXPERT_CHOICES = ("none", "bf16")
NON_EXPERT_SHARD = "model-non-expert.safetensors"
# suh magnitude of a converter-produced expert (RMS of an input row / (1.24371088 * g)), as in real data.
SUH_MAGNITUDE = 0.017


@dataclass(frozen=True)
class SynthSpec:
    """What to synthesize. Exactly one of `partition`, `bitmap`, `uniform_k` sets K per expert.

    partition: (count at k_values[0], count at k_values[1]), e.g. (192, 64); which experts get which K is a
      seeded random permutation per layer, so the tiers interleave over global ids as in real checkpoints.
    bitmap: layer -> K per expert (global id order), for explicit per-layer partitions.
    uniform_k: every expert of every layer at this K (config `bits` is then that integer).
    """

    hidden: int
    intermediate: int  # global MoE intermediate size; intermediate // tp per rank
    experts: int
    tp: int
    layers: tuple[int, ...]
    partition: tuple[int, int] | None = None
    k_values: tuple[int, int] = (3, 4)
    bitmap: Mapping[int, tuple[int, ...]] | None = field(default=None, hash=False)
    uniform_k: int | None = None
    codebook: str = "mcg"
    rotation_layout: str = "per_expert_v1"
    bitmap_field: str = "k"
    top_k: int = 8
    seed: int = 0
    sparse: bool = False
    num_hidden_layers: int | None = None  # default: last MoE layer + 1
    mtp_layers: int = 0  # config num_nextn_predict_layers (GLM-5.2: 1, the MTP head is layer 78)
    # The model's own architecture fields (attention, indexer, vocabulary, dense MLP) that the expert geometry
    # does not set; with them config.json describes the whole model (`trellis fit` reads it), without them
    # config.json names a synthetic architecture that carries only what the experts need.
    model: Mapping[str, object] | None = field(default=None, hash=False, compare=False)
    # The weights besides the routed experts (attention, indexer, norms, router, shared expert, dense MLP,
    # embeddings, lm_head, the MTP layers' own): "none" writes the routed experts only (no engine loads that);
    # "bf16" writes every weight the model class loads, as the GLM-5 release stores them (bf16, the router's
    # e_score_correction_bias float32), in NON_EXPERT_SHARD; holes with `sparse`. Needs `model`.
    non_expert: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if self.bitmap is not None:
            object.__setattr__(self, "bitmap", {int(k): tuple(v) for k, v in self.bitmap.items()})
        _check_spec(self)

    @property
    def intermediate_per_rank(self) -> int:
        return self.intermediate // self.tp

    def expert_k(self, layer: int) -> tuple[int, ...]:
        """K of every expert of one layer, index = global expert id."""
        if self.uniform_k is not None:
            return (self.uniform_k,) * self.experts
        if self.bitmap is not None:
            return self.bitmap[layer]
        assert self.partition is not None  # check_spec: exactly one of uniform_k, bitmap, partition
        low, high = self.k_values
        ids = list(range(self.experts))
        random.Random(f"partition:{self.seed}:{layer}").shuffle(ids)
        high_ids = set(ids[: self.partition[1]])
        return tuple(high if e in high_ids else low for e in range(self.experts))

    def declared_k_values(self) -> tuple[int, ...]:
        """Every K used anywhere, ascending (the config's `k_values` for mixed checkpoints)."""
        if self.uniform_k is not None:
            return (self.uniform_k,)
        if self.partition is not None:
            return tuple(sorted({k for k, n in zip(self.k_values, self.partition) if n}))
        assert self.bitmap is not None  # check_spec: exactly one of uniform_k, bitmap, partition
        return tuple(sorted({k for ks in self.bitmap.values() for k in ks}))

    @property
    def mixed(self) -> bool:
        return len(self.declared_k_values()) > 1

    def mean_bpw(self) -> float:
        """Size-weighted mean K of the routed experts (every expert has the same weight count)."""
        total = sum(sum(self.expert_k(layer)) for layer in self.layers)
        return round(total / (self.experts * len(self.layers)), 2)


def _check_spec(spec: SynthSpec) -> None:
    def bad(message: str) -> UsageError:
        return UsageError(f"synth: {message}")

    for name in ("hidden", "intermediate", "experts", "tp", "top_k"):
        value = getattr(spec, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise bad(f"{name} must be a positive integer, got {value!r}")
    if spec.hidden % 128:
        raise bad(f"hidden {spec.hidden} is not a multiple of 128 (the Hadamard block)")
    if spec.intermediate % spec.tp or spec.intermediate_per_rank % 128:
        raise bad(f"intermediate {spec.intermediate} / tp {spec.tp} must be a whole multiple of 128 per rank")
    if spec.top_k > spec.experts:
        raise bad(f"top_k {spec.top_k} exceeds experts {spec.experts}")
    if not spec.layers or any(not isinstance(x, int) or x < 0 for x in spec.layers):
        raise bad(f"layers must be a non-empty list of non-negative integers, got {list(spec.layers)}")
    if len(set(spec.layers)) != len(spec.layers) or list(spec.layers) != sorted(spec.layers):
        raise bad(f"layers must be ascending without repeats, got {list(spec.layers)}")
    if spec.codebook not in CODEBOOK_MARKERS:
        raise bad(f"codebook must be one of {', '.join(CODEBOOK_MARKERS)}, got {spec.codebook!r}")
    if spec.rotation_layout not in ROTATION_LAYOUTS:
        raise bad(f"rotation_layout must be one of {', '.join(ROTATION_LAYOUTS)}, got {spec.rotation_layout!r}")
    if spec.bitmap_field not in BITMAP_FIELDS:
        raise bad(f"bitmap_field must be one of {', '.join(BITMAP_FIELDS)}, got {spec.bitmap_field!r}")
    if spec.non_expert not in NON_EXPERT_CHOICES:
        raise bad(f"non_expert {spec.non_expert!r}: expected one of {', '.join(NON_EXPERT_CHOICES)}")
    if spec.non_expert != "none" and not spec.model:
        raise bad("the weights besides the experts need the model's architecture fields (a preset's `model`); "
                  "this spec names only the synthetic experts-only architecture")
    if spec.num_hidden_layers is not None and spec.num_hidden_layers < spec.layers[-1]:
        raise bad(f"num_hidden_layers {spec.num_hidden_layers} is below the last MoE layer {spec.layers[-1]}")
    _check_k_choice(spec, bad)


def _check_k_choice(spec: SynthSpec, bad: Callable[[str], UsageError]) -> None:
    chosen = [spec.partition is not None, spec.bitmap is not None, spec.uniform_k is not None]
    if sum(chosen) != 1:
        raise bad("give exactly one of partition, bitmap, uniform K")
    ks: set[int] = set()
    if spec.partition is not None:
        if len(spec.partition) != 2 or any(n < 0 for n in spec.partition) or sum(spec.partition) != spec.experts:
            shown = "/".join(map(str, spec.partition))
            raise bad(f"partition {shown} must be two counts summing to experts {spec.experts} (pass "
                      f"--partition LOW/HIGH with LOW + HIGH = {spec.experts})")
        if len(set(spec.k_values)) != 2:
            raise bad(f"k_values {spec.k_values} must be two different bitrates")
        ks = set(spec.k_values)
    elif spec.bitmap is not None:
        if set(spec.bitmap) != set(spec.layers):
            raise bad(f"bitmap layers {sorted(spec.bitmap)} differ from layers {list(spec.layers)}")
        for layer, layer_ks in spec.bitmap.items():
            if len(layer_ks) != spec.experts:
                raise bad(f"bitmap layer {layer} has {len(layer_ks)} entries, expected experts {spec.experts}")
            ks |= set(layer_ks)
    elif spec.uniform_k is not None:  # the one left
        ks = {spec.uniform_k}
    if any(not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 8 for k in ks):
        raise bad(f"bitrates must be integers in 1..8, got {sorted(ks, key=str)}")


# GLM-5 / GLM-5.2 (`GlmMoeDsaConfig`, model_type glm_moe_dsa): MLA with the DSA indexer on every layer.
GLM_MOE_DSA = {
    "vocab_size": 154880, "intermediate_size": 12288, "n_shared_experts": 1,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512,
    "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048,
    "max_position_embeddings": 202752, "tie_word_embeddings": False, "rms_norm_eps": 1e-5,
    "topk_method": "noaux_tc",
}
# The same architecture at toy size (the indexer keeps its 128-wide key: its fp8 scale block is 128).
TINY_GLM_MOE_DSA = GLM_MOE_DSA | {
    "vocab_size": 512, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "index_n_heads": 2, "index_topk": 64, "max_position_embeddings": 4096,
}

PRESETS: dict[str, SynthSpec] = {
    "glm52-tp4": SynthSpec(hidden=6144, intermediate=2048, experts=256, tp=4, layers=tuple(range(3, 79)),
                           partition=(192, 64), top_k=8, num_hidden_layers=78, mtp_layers=1, model=GLM_MOE_DSA),
    "tiny": SynthSpec(hidden=256, intermediate=256, experts=8, tp=2, layers=(3, 4), partition=(6, 2), top_k=2,
                      model=TINY_GLM_MOE_DSA, non_expert="bf16"),
}


def preset(name: str) -> SynthSpec:
    if name not in PRESETS:
        raise UsageError(f"synth: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    return PRESETS[name]


# ---- tensor data ---------------------------------------------------------------------------------------

class TensorSource(Protocol):
    """Where tensor data comes from. Shapes and dtypes must match the plan (checked when written)."""

    def linear(self, layer: int, expert: int, proj: str, rank: int, k: int) -> Mapping[str, torch.Tensor]:
        """{"trellis": int16, "suh": fp16, "svh": fp16} of one rank slice of one projection."""

    def shared_h(self, layer: int, proj: str, rank: int) -> torch.Tensor:
        """The layer-shared hidden-side vector (fp16 [hidden]) of one projection and rank."""


def _generator(*parts: object) -> torch.Generator:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def random_suh(n: int, gen: torch.Generator) -> torch.Tensor:
    """Nonzero, random signs, magnitudes spread log-normally around a converter-like scale."""
    signs = torch.randint(0, 2, (n,), generator=gen).mul(2).sub(1).float()
    magnitude = SUH_MAGNITUDE * torch.exp(0.15 * torch.randn(n, generator=gen))
    return (signs * magnitude).half()


def random_svh(n: int, gen: torch.Generator) -> torch.Tensor:
    """About ±1 with mean |svh| = 1 (column scales normalized to mean 1, random signs)."""
    signs = torch.randint(0, 2, (n,), generator=gen).mul(2).sub(1).float()
    magnitude = (1 + 0.05 * torch.randn(n, generator=gen)).abs()
    return (signs * magnitude / magnitude.mean()).half()


def linear_shapes(spec: SynthSpec, proj: str, k: int) -> dict[str, tuple[int, ...]]:
    """Shapes of one rank slice: gate/up are sliced along N (output), down along K (input)."""
    h, i = spec.hidden, spec.intermediate_per_rank
    fan_in, fan_out = (h, i) if proj != "down_proj" else (i, h)
    return {"trellis": (fan_in // 16, fan_out // 16, 16 * k), "suh": (fan_in,), "svh": (fan_out,)}


@dataclass
class RandomTensors:
    """Seeded random data: the same (seed, layer, expert, proj, rank) always gives the same tensors."""

    spec: SynthSpec

    def linear(self, layer: int, expert: int, proj: str, rank: int, k: int) -> dict[str, torch.Tensor]:
        gen = _generator(self.spec.seed, layer, expert, proj, rank)
        shapes = linear_shapes(self.spec, proj, k)
        trellis = torch.randint(-32768, 32768, shapes["trellis"], dtype=torch.int16, generator=gen)
        return {"trellis": trellis, "suh": random_suh(shapes["suh"][0], gen), "svh": random_svh(shapes["svh"][0], gen)}

    def shared_h(self, layer: int, proj: str, rank: int) -> torch.Tensor:
        gen = _generator(self.spec.seed, layer, "shared_h", proj, rank)
        make = random_suh if HIDDEN_SIDE_FIELD[proj] == "suh" else random_svh
        return make(self.spec.hidden, gen)


# ---- layer plan ----------------------------------------------------------------------------------------

class _Slot(NamedTuple):
    """One tensor of a shard in header order, with what produces it."""

    tensor: PlannedTensor
    origin: tuple[Any, ...]  # ("linear", expert, proj, rank, k, field) | ("marker",) | ("shared_h", proj, rank)


def _layer_slots(spec: SynthSpec, layer: int) -> Iterator[_Slot]:
    shared = spec.rotation_layout == "shared_h_v1"
    marker = CODEBOOK_MARKERS[spec.codebook]
    shapes_by_k = {(proj, k): linear_shapes(spec, proj, k) for proj in PROJECTIONS for k in range(1, 9)}
    for expert, k in enumerate(spec.expert_k(layer)):
        for proj in PROJECTIONS:
            shapes = shapes_by_k[proj, k]
            for rank in range(spec.tp):
                for name, dtype in (("trellis", "I16"), ("suh", "F16"), ("svh", "F16")):
                    if shared and HIDDEN_SIDE_FIELD[proj] == name:
                        continue
                    key = expert_key(layer, expert, proj, rank, name)
                    yield _Slot(PlannedTensor(key, dtype, shapes[name]), ("linear", expert, proj, rank, k, name))
                if marker is not None:
                    key = expert_key(layer, expert, proj, rank, marker[0])
                    yield _Slot(PlannedTensor(key, "I32", ()), ("marker",))
    if shared:
        for proj in PROJECTIONS:
            for rank in range(spec.tp):
                yield _Slot(PlannedTensor(shared_h_key(layer, proj, rank), "F16", (spec.hidden,)),
                            ("shared_h", proj, rank))


def layer_bytes(spec: SynthSpec, layer: int) -> int:
    """Tensor data bytes of one layer's shard, by arithmetic (equals the sum over `layer_plan`)."""
    h, i = spec.hidden, spec.intermediate_per_rank
    shared = spec.rotation_layout == "shared_h_v1"
    trellis_bytes_per_k = 3 * h * i * 2 // 16  # three projections: (H/16)(I/16) tiles of 16K int16 words
    vectors = 3 * 2 * (i if shared else h + i)
    marker = 0 if CODEBOOK_MARKERS[spec.codebook] is None else 3 * 4
    experts = sum(trellis_bytes_per_k * k + vectors + marker for k in spec.expert_k(layer))
    return spec.tp * experts + (3 * spec.tp * 2 * h if shared else 0)


def layer_tensor_count(spec: SynthSpec) -> int:
    """Tensors in one layer's shard, by arithmetic (equals len(layer_plan))."""
    fields = (2 if spec.rotation_layout == "shared_h_v1" else 3) + (CODEBOOK_MARKERS[spec.codebook] is not None)
    shared_rows = 3 * spec.tp if spec.rotation_layout == "shared_h_v1" else 0
    return spec.experts * 3 * spec.tp * fields + shared_rows


def check_limits(spec: SynthSpec) -> None:
    """Refuse, before any work, a shard with more tensors than a safetensors header may list here (validate's
    file.too-many-tensors): its plan alone would take minutes and gigabytes to build."""
    tensors = layer_tensor_count(spec)
    if tensors > MAX_HEADER_TENSORS:
        raise UsageError(f"synth: one layer shard would hold {tensors:,} tensors ({spec.experts} experts x 3 "
                         f"projections x tp {spec.tp}), above the limit of {MAX_HEADER_TENSORS:,} per file")


def disk_bytes(spec: SynthSpec) -> int:
    """What writing `spec` puts on disk: the tensor data (none when sparse) and about 256 bytes per tensor of
    headers and index."""
    data = 0 if spec.sparse else checkpoint_bytes(spec)
    return data + 256 * (layer_tensor_count(spec) * len(spec.layers) + len(non_expert_plan(spec)))


def checkpoint_bytes(spec: SynthSpec) -> int:
    """Tensor data bytes of the whole checkpoint (the index's total_size)."""
    check_limits(spec)
    return sum(layer_bytes(spec, layer) for layer in spec.layers) + sum(t.nbytes for t in non_expert_plan(spec))


def non_expert_plan(spec: SynthSpec) -> list[PlannedTensor]:
    """The weights besides the routed experts that `spec.non_expert` writes: every weight the model class
    loads for config.json's architecture (checkpoint/architecture.py), the MTP layers' included."""
    if spec.non_expert == "none":
        return []
    from trellis_cli.checkpoint.architecture import model_weights

    weights = model_weights(model_config(spec))
    if weights is None:
        raise UsageError(f"synth: model_type {model_config(spec).get('model_type')!r} has no weight list")
    every = weights.main + [w for layer in sorted(weights.mtp) for w in weights.mtp[layer]]
    return [PlannedTensor(w.name, "F32" if w.name.endswith("e_score_correction_bias") else "BF16", w.shape)
            for w in every]


def write_non_expert(path: Path, spec: SynthSpec) -> list[PlannedTensor]:
    """The non-expert shard: seeded random weights (std 0.02, norms about 1), or holes when sparse."""
    plan = non_expert_plan(spec)
    with SafetensorsWriter(path, plan, {"format": "pt"}) as writer:
        for tensor in plan:
            if spec.sparse:
                writer.skip(tensor.name)
                continue
            gen = _generator(spec.seed, "non-expert", tensor.name)
            data = torch.randn(tensor.shape, generator=gen, dtype=torch.float32)
            norm = tensor.name.endswith("norm.weight")
            data = 1.0 + 0.05 * data if norm else 0.02 * data
            writer.write(tensor.name, data.to(torch.float32 if tensor.dtype == "F32" else torch.bfloat16))
    return plan


def layer_plan(spec: SynthSpec, layer: int) -> list[PlannedTensor]:
    """Every tensor of one layer's shard in header order (keys, dtypes, shapes)."""
    return [slot.tensor for slot in _layer_slots(spec, layer)]


def _write_layer(path: Path, spec: SynthSpec, layer: int, source: TensorSource) -> tuple[list[PlannedTensor], int]:
    """Write one shard; returns its plan and its data bytes."""
    slots = list(_layer_slots(spec, layer))
    plan = [slot.tensor for slot in slots]
    marker = CODEBOOK_MARKERS[spec.codebook]
    marker_value = 0 if marker is None else marker[1]  # read only where _layer_slots plans a marker
    with SafetensorsWriter(path, plan, {"format": "pt"}) as writer:
        if spec.sparse:  # holes for the data; the 4-byte codebook markers are real, as loaders read them
            for slot in slots:
                if slot.origin[0] == "marker":
                    writer.write(slot.tensor.name, torch.tensor(marker_value, dtype=torch.int32))
                else:
                    writer.skip(slot.tensor.name)
            return plan, writer.data_bytes
        current: tuple[Any, ...] | None = None
        tensors: Mapping[str, torch.Tensor] = {}
        for slot in slots:
            kind, *where = slot.origin
            if kind == "linear":
                expert, proj, rank, k, name = where
                if current != (expert, proj, rank):  # one linear in memory at a time
                    current, tensors = (expert, proj, rank), source.linear(layer, expert, proj, rank, k)
                data = tensors[name]
            elif kind == "marker":
                data = torch.tensor(marker_value, dtype=torch.int32)
            else:
                data = source.shared_h(layer, *where)
            _check_data(path.name, slot.tensor, data)
            writer.write(slot.tensor.name, data)
    return plan, writer.data_bytes


_TORCH_DTYPES = {"I16": torch.int16, "F16": torch.float16, "I32": torch.int32}


def _check_data(file: str, planned: PlannedTensor, data: torch.Tensor) -> None:
    if data.dtype != _TORCH_DTYPES[planned.dtype] or tuple(data.shape) != planned.shape:
        raise CheckFailed(f"{file}: {planned.name}: source gave {str(data.dtype).removeprefix('torch.')} "
                          f"{list(data.shape)}, expected {planned.dtype} {list(planned.shape)}")


# ---- JSON files ----------------------------------------------------------------------------------------

def hybrid_tr3_tail(spec: SynthSpec) -> dict[str, Any]:
    """The rank-sliced contract block of config.json."""
    first, last = spec.layers[0], spec.layers[-1]
    block: dict[str, Any] = {"format": FORMAT}
    if spec.mixed:
        block |= {"bits": "mixed", "k_values": list(spec.declared_k_values()),
                  "bits_per_expert": f"tier_bitmap.json:{spec.bitmap_field}"}
    else:
        k = spec.declared_k_values()[0]
        block |= {"bits": k, "trellis_bits_by_layer": {str(layer): k for layer in spec.layers}}
    block |= {
        "codebook": spec.codebook,
        "experts_per_layer": spec.experts,
        "moe_layers": [first, last],
        "tensor_schema": TENSOR_SCHEMA,
        "tp": spec.tp,
        "rotation_layout": spec.rotation_layout,
    }
    if spec.rotation_layout == "shared_h_v1":
        block["shared_h_tensor_schema"] = SHARED_H_TENSOR_SCHEMA
    block |= {"tr3_tail_per_layer": spec.experts, "nvfp4_keep_per_layer": 0, "producer_version": PRODUCER}
    return block


def model_config(spec: SynthSpec) -> dict[str, Any]:
    """The architecture part of config.json: geometry from the spec, the rest from `spec.model`."""
    named = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa"} if spec.model else {
        "architectures": ["TrellisSynthMoeForCausalLM"], "model_type": "trellis_synth_moe"}
    return named | {
        "hidden_size": spec.hidden,
        "moe_intermediate_size": spec.intermediate,
        "n_routed_experts": spec.experts,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": spec.num_hidden_layers if spec.num_hidden_layers is not None else spec.layers[-1] + 1,
        "num_nextn_predict_layers": spec.mtp_layers,
        "first_k_dense_replace": spec.layers[0],
        "torch_dtype": "bfloat16" if spec.model else "float16",
        **(spec.model or {}),
    }


def config_json(spec: SynthSpec) -> dict[str, Any]:
    return model_config(spec) | {
        "hybrid_tr3_tail": hybrid_tr3_tail(spec),
        "quantization_config": {"quant_method": "exl3", "bits": spec.mean_bpw(), "codebook": spec.codebook},
    }


def tier_bitmap_json(spec: SynthSpec) -> dict[str, Any]:
    """Per layer: K per expert under the chosen field name, plus the hybrid lineage lists (all trellis)."""
    return {
        str(layer): {spec.bitmap_field: list(spec.expert_k(layer)),
                     "tail_tr3": list(range(spec.experts)), "keep_nvfp4": []}
        for layer in spec.layers
    }


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


def _write_manifest(stage: Path) -> None:
    write_manifest(stage, [p.name for p in stage.iterdir() if p.is_file()])


# ---- the checkpoint ------------------------------------------------------------------------------------

def write_checkpoint(out_dir: str | Path, spec: SynthSpec, progress: Callable[[int], None] | None = None, *,
                     source: TensorSource | None = None, overwrite: bool = False) -> Path:
    """Write a complete TR3 checkpoint for `spec` into `out_dir`; returns its path.

    `progress(layer)` is called after each layer's shard is written. `source` defaults to seeded random
    data. A non-empty `out_dir` is refused unless `overwrite`. Nothing appears at `out_dir` unless the
    whole checkpoint was written (it is staged in `out_dir.partial`, removed on any error).
    """
    check_limits(spec)
    return staged_output(out_dir, overwrite, lambda stage: _write_all(stage, spec, source or RandomTensors(spec),
                                                                      progress), needed=disk_bytes(spec))


def staged_output(out_dir: str | Path, overwrite: bool, write: Callable[[Path], None], *, needed: int = 0) -> Path:
    """`write(stage)` into `OUT.partial`, then move it into place; on any error (Ctrl-C too) the stage is
    removed and OUT is untouched. A non-empty OUT is refused unless `overwrite`; so are an OUT or OUT.partial
    that is a symbolic link or not a directory, and a filesystem without `needed` bytes free (before anything
    is written)."""
    out = Path(out_dir)
    check_target(out, overwrite)
    stage = out.with_name(out.name + ".partial")
    _check_target(out, stage, overwrite)
    require_free_space(out, needed, "synth")
    if stage.exists():
        shutil.rmtree(stage)  # left over from an interrupted run: it is ours by name
    stage.mkdir(parents=True)
    try:
        write(stage)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(stage, out)
    return out


def _check_target(out: Path, stage: Path, overwrite: bool) -> None:
    for path, what in ((out, "OUT"), (stage, "the staging directory of OUT")):
        if path.is_symlink():  # replacing it would delete through the link, outside OUT
            raise UsageError(f"synth: {path} ({what}) is a symbolic link (to {os.readlink(path)}); synth writes "
                             "a directory of its own: name the directory itself, or remove the link")
    if stage.exists() and not stage.is_dir():
        raise UsageError(f"synth: {stage} (the staging directory of OUT) exists and is not a directory (remove it)")


def check_target(out: Path, overwrite: bool) -> None:
    """Refuse a file, or a non-empty directory without `overwrite`: before anything is said or written."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"synth: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UsageError(f"synth: {out} exists and is not empty (pass --overwrite to replace it)")


def _write_all(stage: Path, spec: SynthSpec, source: TensorSource, progress: Callable[[int], None] | None) -> None:
    _write_json(stage / "config.json", config_json(spec))
    _write_json(stage / "tier_bitmap.json", tier_bitmap_json(spec))
    weight_map: dict[str, str] = {}
    total = 0
    for layer in spec.layers:
        plan, data_bytes = _write_layer(stage / shard_name(layer), spec, layer, source)
        weight_map.update(dict.fromkeys((t.name for t in plan), shard_name(layer)))
        total += data_bytes
        if progress is not None:
            progress(layer)
    if spec.non_expert != "none":
        plan = write_non_expert(stage / NON_EXPERT_SHARD, spec)
        weight_map.update(dict.fromkeys((t.name for t in plan), NON_EXPERT_SHARD))
        total += sum(t.nbytes for t in plan)
    # Compact: a production index maps ~935k tensors, and indenting it would triple the write time.
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (stage / "model.safetensors.index.json").write_text(json.dumps(index, separators=(",", ":")), encoding="utf-8")
    if not spec.sparse:
        _write_manifest(stage)


@dataclass(frozen=True)
class SynthSummary:
    """What `trellis synth` wrote (geometry, partitions, sizes); its fields in the order of `synth --json`."""

    path: str
    hidden: int
    intermediate: int
    intermediate_per_rank: int
    experts: int
    tp: int
    top_k: int
    layers: list[int]
    rotation_layout: str
    codebook: str
    bits: str | int  # "mixed", or the one K of a uniform checkpoint
    mean_bpw: float
    partitions: dict[str, dict[str, int]]  # layer -> "K<k>" -> experts
    tensors_per_layer: int
    tensor_bytes: int
    files: list[str]
    sparse: bool
    seed: int
    non_expert: str
    non_expert_tensors: int
    model_type: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summary(spec: SynthSpec, out: str | Path) -> SynthSummary:
    """A description of a written checkpoint (geometry, partitions, sizes)."""
    out = Path(out)
    index = json.loads((out / "model.safetensors.index.json").read_text(encoding="utf-8"))
    partitions = {}
    for layer in spec.layers:
        ks = spec.expert_k(layer)
        partitions[str(layer)] = {f"K{k}": ks.count(k) for k in sorted(set(ks))}
    return SynthSummary(
        path=str(out),
        hidden=spec.hidden, intermediate=spec.intermediate, intermediate_per_rank=spec.intermediate_per_rank,
        experts=spec.experts, tp=spec.tp, top_k=spec.top_k, layers=list(spec.layers),
        rotation_layout=spec.rotation_layout, codebook=spec.codebook,
        bits=hybrid_tr3_tail(spec)["bits"], mean_bpw=spec.mean_bpw(), partitions=partitions,
        tensors_per_layer=len(layer_plan(spec, spec.layers[0])),
        tensor_bytes=index["metadata"]["total_size"],
        files=sorted(p.name for p in out.iterdir()),
        sparse=spec.sparse, seed=spec.seed,
        non_expert=spec.non_expert, non_expert_tensors=len(non_expert_plan(spec)),
        model_type=model_config(spec)["model_type"],
    )
