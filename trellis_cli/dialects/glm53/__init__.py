"""GLM-5.3-Flash routed-experts-only EXL3 (`quantization_config.scope: "glm53_routed_experts_only"`), the layout
the fork's R7-era loader calls `source_layout: "unsliced_tp_stream"`: full-width K4 experts under
`model.language_model.layers.{L}.mlp.experts.{E}.{proj}.{trellis|suh|svh|mcg}`, no rank segment, every rank
cutting its slice while loading; every other tensor in the source's own dtype.

Everything trellis knows about it lives here: `contract` (the scope, schema, the loader's exact gate), `container`
(the checkpoint model, read from headers by its own schema), `rules` (format rules), `synth` (synthetic
checkpoints), `write` (the stream written back from rank slices). Its loader verdicts are validate's
`vllm-exl3-r7` and `vllm-exl3-pr766` profiles; docs/checkpoint-dialects.md describes the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trellis_cli.checkpoint.model import DIALECT_TR3_PER_EXPERT, Checkpoint, Declarations
from trellis_cli.dialects.glm53.contract import DIALECT_GLM53, SCOPE, quant_block, text_config
from trellis_cli.dialects.interface import VLLM, VLLM_R7, CheckRequest, ContainerRefusal, Dialect, DialectInfo, Probe


@dataclass
class Glm53Declarations(Declarations):
    """The quantization block that declares the scope, and the file it is in."""

    quantization: dict[str, Any]
    declared_in: str  # "config.json" (embedded, what the loader reads) or "quantization_config.json"


class Glm53StreamDialect(Dialect):
    name = DIALECT_GLM53
    target = "glm53-stream"
    synth = "trellis_cli.dialects.glm53.synth"
    described_as = "a GLM-5.3 unsliced-stream (glm53_routed_experts_only)"
    default_engine = "vllm-exl3-r7"  # the fork's loader version that recognizes the scope
    read_by = frozenset({VLLM_R7})
    container_notes = {VLLM: "the glm53_routed_experts_only scope is recognized from the R7-era version on; "
                             "this version takes quant_method exl3 as plain EXL3 and needs tensor_storage, which "
                             "the release does not carry"}
    writer = "trellis_cli.dialects.glm53.write"
    converts_from = {DIALECT_TR3_PER_EXPERT: "tr3-to-glm53-stream"}
    drivers = {"tr3-to-glm53-stream": "trellis_cli.dialects.glm53.stream:Tr3ToStream"}

    def scope_declared(self, ckpt: Checkpoint) -> str | None:
        from trellis_cli.dialects.glm53.gate import scope_declared

        return scope_declared(ckpt)

    def scope_refusals(self, ckpt: Checkpoint, layers: list[int], part: str) -> list[ContainerRefusal]:
        from trellis_cli.dialects.glm53 import gate

        walk = {"metadata": gate.metadata_refusals, "tensors": gate.tensor_refusals,
                "external": gate.external_refusals}[part]
        return list(walk(ckpt, layers))

    def detect(self, probe: Probe) -> DialectInfo | None:
        block, where = quant_block(probe.config, probe.quant_config)
        if block is None or where is None:
            return None
        codebook = block.get("codebook")
        return DialectInfo(DIALECT_GLM53, "per_expert_v1", 1, codebook if isinstance(codebook, str) else None,
                           Glm53Declarations(block, where))

    def fill(self, ckpt, probe: Probe, info: DialectInfo) -> bool:
        from trellis_cli.dialects.glm53.container import fill_checkpoint

        fill_checkpoint(ckpt, probe.files)
        return True

    def check(self, ckpt, request: CheckRequest, report) -> None:
        from trellis_cli.dialects.glm53.contract import moe_layers
        from trellis_cli.dialects.glm53.rules import check_config, check_markers, check_tensors

        report.extend(ckpt.parse_findings)
        report.extend(check_config(ckpt))
        layers = request.layers
        if not request.narrowed:  # a declared MoE layer with no tensors is checked (and reported) too
            layers = sorted(set(layers) | set(moe_layers(text_config(ckpt.config)) or []))
        report.extend(check_tensors(ckpt, layers))
        report.extend(check_markers(ckpt, request.layers))
        report.count("files", len(ckpt.headers))
        report.count("tensors", len(ckpt.tensors))
        report.count("layers", len(layers))
        report.count("linears", sum(len(p) for li in request.layers for p in ckpt.layers[li].experts.values()))

    def declared_layers(self, ckpt) -> list[int]:
        from trellis_cli.dialects.glm53.contract import moe_layers

        return sorted(set(moe_layers(text_config(ckpt.config)) or []) | set(ckpt.layers))

    def container_refusal(self, family: str):
        from trellis_cli.dialects.interface import EXLLAMAV3, ContainerRefusal

        if family == EXLLAMAV3:
            return ContainerRefusal("not profiled", f"{self.described_as} checkpoint: exllamav3's loader of the "
                                    "glm5_next architecture is not profiled here, so trellis claims no verdict "
                                    "for it (the release itself records serving_reader_qualified false)",
                                    expected="a profiled exllamav3 architecture")
        return super().container_refusal(family)


DIALECT = Glm53StreamDialect()
__all__ = ["DIALECT", "SCOPE"]
