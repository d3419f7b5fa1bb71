"""Synthetic GLM-5.3 unsliced-stream checkpoints: `trellis synth --preset glm53-flash | glm53-tiny`.

config.json names the multimodal wrapper (`Glm5NextForConditionalGeneration`, `text_config` of model type
`glm5_next_text`) and embeds the release's quantization block (scope `glm53_routed_experts_only`);
quantization_config.json repeats it, as the releases do. One shard holds the non-routed tensors (BF16, a
representative set: embeddings, lm_head, norms, the shared expert of each MoE layer), then one shard per MoE layer
holds its full-width experts in the loader's schema. Codes are seeded random int16 (every pattern is a valid trellis
code) with converter-like suh/svh; `sparse` writes headers over holes (the markers stay real), so the
production-size preset (43 layers x 288 experts, ~156 GB apparent) takes seconds.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from trellis_cli.dialects.glm53.contract import (ARCHITECTURE, DTYPES, FIELDS, LINEAR_ATTN, PROJECTIONS, SCOPE,
                                                expert_key, linear_shapes)
from trellis_cli.codebooks import MCG_MARKER
from trellis_cli.errors import UsageError
from trellis_cli.header_records import MAX_HEADER_TENSORS
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter
from trellis_cli.synth import _generator, random_suh, random_svh, staged_output

PRODUCER_VERSION = "0.0.43"  # the exllamav3 version the releases record; the block is copied as they write it


@dataclass(frozen=True)
class StreamSpec:
    """Geometry and K of a synthetic stream. MoE layers are first_dense .. main_layers + mtp_layers - 1."""

    hidden: int
    intermediate: int
    experts: int
    first_dense: int
    main_layers: int  # text_config num_hidden_layers
    mtp_layers: int
    bits: int
    top_k: int
    vocab: int
    seed: int = 0
    sparse: bool = False
    model: Mapping[str, object] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "experts", "main_layers", "top_k", "vocab"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UsageError(f"synth: {name} must be a positive integer, got {value!r}")
        if self.hidden % 128 or self.intermediate % 128:
            raise UsageError(f"synth: hidden {self.hidden} and intermediate {self.intermediate} must be multiples "
                             "of 128 (the Hadamard block)")
        if not 1 <= self.bits <= 8:
            raise UsageError(f"synth: bits must be in 1..8, got {self.bits}")
        if self.top_k > self.experts:
            raise UsageError(f"synth: top_k {self.top_k} exceeds experts {self.experts}")
        if not 0 <= self.first_dense < self.main_layers + self.mtp_layers:
            raise UsageError(f"synth: no MoE layer between first_k_dense_replace {self.first_dense} and "
                             f"{self.main_layers + self.mtp_layers - 1}")
        if self.experts * 3 * len(FIELDS) > MAX_HEADER_TENSORS:
            raise UsageError(f"synth: one layer shard would hold {self.experts * 12:,} tensors, above the limit "
                             f"of {MAX_HEADER_TENSORS:,} per file")

    @property
    def layers(self) -> list[int]:
        return list(range(self.first_dense, self.main_layers + self.mtp_layers))

    @property
    def all_layers(self) -> int:
        return self.main_layers + self.mtp_layers


_FLASH_MODEL = {k: v for k, v in ARCHITECTURE.items()
                if k not in ("model_type", "num_hidden_layers", "num_nextn_predict_layers", "first_k_dense_replace",
                             "n_routed_experts", "hidden_size", "moe_intermediate_size")}
PRESETS: dict[str, StreamSpec] = {
    "glm53-flash": StreamSpec(hidden=4096, intermediate=2048, experts=288, first_dense=3, main_layers=45,
                              mtp_layers=1, bits=4, top_k=8, vocab=154880,
                              model=_FLASH_MODEL | {"linear_attn_config": dict(LINEAR_ATTN), "n_shared_experts": 1}),
    # The same layout at toy size: MoE layers 3, 4 and the MTP layer 5; TP 1, 2 and 4 cut it into whole
    # 128-channel blocks. Its geometry is not the loader's exact gate, so the R7 profile refuses it by field.
    "glm53-tiny": StreamSpec(hidden=256, intermediate=512, experts=8, first_dense=3, main_layers=5, mtp_layers=1,
                             bits=4, top_k=2, vocab=512,
                             model=_FLASH_MODEL | {"index_n_heads": 2, "index_topk": 64, "qk_nope_head_dim": 32,
                                                   "v_head_dim": 32, "n_shared_experts": 1,
                                                   "linear_attn_config": {"num_heads": 2, "head_dim": 128,
                                                                          "short_conv_kernel_size": 4,
                                                                          "full_attn_layers": [3]}}),
}


def preset(name: str, **changes: Any) -> StreamSpec:
    if name not in PRESETS:
        raise UsageError(f"synth: unknown GLM-5.3 preset {name!r} (known: {', '.join(PRESETS)})")
    given = {k: v for k, v in changes.items() if v is not None}
    return dataclasses.replace(PRESETS[name], **given) if given else PRESETS[name]


def quantization_block(spec: StreamSpec) -> dict[str, Any]:
    return {"bits": spec.bits, "codebook": "mcg", "head_bits": 16, "non_routed_dtype_policy": "official_source_native",
            "quant_method": "exl3", "scope": SCOPE, "serving_reader_qualified": False, "version": PRODUCER_VERSION}


def config_json(spec: StreamSpec) -> dict[str, Any]:
    text = {"model_type": "glm5_next_text", "hidden_size": spec.hidden, "moe_intermediate_size": spec.intermediate,
            "n_routed_experts": spec.experts, "num_experts_per_tok": spec.top_k,
            "num_hidden_layers": spec.main_layers, "num_nextn_predict_layers": spec.mtp_layers,
            "first_k_dense_replace": spec.first_dense, "vocab_size": spec.vocab, **spec.model}
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "text_config": text, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "quantization_config": quantization_block(spec)}


def shard_names(spec: StreamSpec) -> tuple[str, dict[int, str]]:
    total = 1 + len(spec.layers)
    name = lambda n: f"model-{n:05d}-of-{total:05d}.safetensors"  # noqa: E731
    return name(1), {layer: name(2 + i) for i, layer in enumerate(spec.layers)}


def _non_routed(spec: StreamSpec) -> list[PlannedTensor]:
    h, i = spec.hidden, spec.intermediate
    out = [PlannedTensor("model.language_model.embed_tokens.weight", "BF16", (spec.vocab, h)),
           PlannedTensor("lm_head.weight", "BF16", (spec.vocab, h)),
           PlannedTensor("model.language_model.norm.weight", "BF16", (h,))]
    for layer in range(spec.all_layers):
        out.append(PlannedTensor(f"model.language_model.layers.{layer}.input_layernorm.weight", "BF16", (h,)))
    for layer in spec.layers:
        base = f"model.language_model.layers.{layer}.mlp.shared_experts"
        out += [PlannedTensor(f"{base}.gate_proj.weight", "BF16", (i, h)),
                PlannedTensor(f"{base}.up_proj.weight", "BF16", (i, h)),
                PlannedTensor(f"{base}.down_proj.weight", "BF16", (h, i))]
    return out


def layer_plan(spec: StreamSpec, layer: int) -> list[PlannedTensor]:
    plan = []
    for expert in range(spec.experts):
        for proj in PROJECTIONS:
            shapes = linear_shapes(spec.hidden, spec.intermediate, proj, spec.bits)
            plan += [PlannedTensor(expert_key(layer, expert, proj, f), DTYPES[f], shapes[f]) for f in FIELDS]
    return plan


def linear_data(spec: StreamSpec, layer: int, expert: int, proj: str) -> dict[str, torch.Tensor]:
    gen = _generator(spec.seed, "glm53", layer, expert, proj)
    shapes = linear_shapes(spec.hidden, spec.intermediate, proj, spec.bits)
    return {"trellis": torch.randint(-32768, 32768, shapes["trellis"], dtype=torch.int16, generator=gen),
            "suh": random_suh(shapes["suh"][0], gen), "svh": random_svh(shapes["svh"][0], gen),
            "mcg": torch.tensor(MCG_MARKER, dtype=torch.int32)}


def checkpoint_bytes(spec: StreamSpec) -> int:
    return sum(t.nbytes for t in _non_routed(spec)) + sum(t.nbytes for t in layer_plan(spec, spec.layers[0])) * \
        len(spec.layers)


def write_stream_checkpoint(out_dir: str | Path, spec: StreamSpec, progress: Callable[[int], None] | None = None, *,
                            overwrite: bool = False) -> Path:
    """Write the stream checkpoint of `spec` (staged in OUT.partial, moved into place when complete)."""

    def write(stage: Path) -> None:
        first, per_layer = shard_names(spec)
        weight_map: dict[str, str] = {}
        plan = _non_routed(spec)
        with SafetensorsWriter(stage / first, plan, {"format": "pt"}) as writer:
            for t in plan:
                if spec.sparse:
                    writer.skip(t.name)
                else:
                    gen = _generator(spec.seed, "glm53-native", t.name)
                    writer.write(t.name, (torch.randn(t.shape, generator=gen) * 0.02).to(torch.bfloat16))
                weight_map[t.name] = first
        for layer in spec.layers:
            plan = layer_plan(spec, layer)
            with SafetensorsWriter(stage / per_layer[layer], plan, {"format": "pt"}) as writer:
                for name, data in _layer_data(spec, layer):
                    if data is None:
                        writer.skip(name)
                    else:
                        writer.write(name, data)
            weight_map.update(dict.fromkeys((t.name for t in plan), per_layer[layer]))
            if progress is not None:
                progress(layer)
        total = sum(t.nbytes for t in _non_routed(spec)) + sum(
            t.nbytes for layer in spec.layers for t in layer_plan(spec, layer))
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (stage / "model.safetensors.index.json").write_text(json.dumps(index, separators=(",", ":")),
                                                            encoding="utf-8")
        config = config_json(spec)
        (stage / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        (stage / "quantization_config.json").write_text(json.dumps(config["quantization_config"], indent=2) + "\n",
                                                        encoding="utf-8")

    return staged_output(out_dir, overwrite, write, needed=0 if spec.sparse else checkpoint_bytes(spec))


def _layer_data(spec: StreamSpec, layer: int) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Each tensor of one layer shard in plan order, one linear in memory at a time (None: a hole)."""
    marker = torch.tensor(MCG_MARKER, dtype=torch.int32)
    for expert in range(spec.experts):
        for proj in PROJECTIONS:
            data = None if spec.sparse else linear_data(spec, layer, expert, proj)
            for f in FIELDS:
                name = expert_key(layer, expert, proj, f)
                if f == "mcg":
                    yield name, marker
                else:
                    yield name, None if data is None else data[f]


@dataclass(frozen=True)
class StreamSynthSummary:
    """What `trellis synth --preset glm53-*` wrote; its fields in the order of `synth --json`."""

    path: str
    format: str
    scope: str
    hidden: int
    intermediate: int
    experts: int
    layers: list[int]
    mtp_layers: int
    bits: int
    codebook: str
    top_k: int
    tensors_per_layer: int
    tensor_bytes: int
    sparse: bool
    seed: int
    files: list[str]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summary(spec: StreamSpec, out: str | Path) -> StreamSynthSummary:
    return StreamSynthSummary(
        path=str(out), format="glm53-stream", scope=SCOPE, hidden=spec.hidden,
        intermediate=spec.intermediate, experts=spec.experts, layers=spec.layers,
        mtp_layers=spec.mtp_layers, bits=spec.bits, codebook="mcg", top_k=spec.top_k,
        tensors_per_layer=spec.experts * 3 * len(FIELDS), tensor_bytes=checkpoint_bytes(spec),
        sparse=spec.sparse, seed=spec.seed, files=sorted(p.name for p in Path(out).iterdir()))
