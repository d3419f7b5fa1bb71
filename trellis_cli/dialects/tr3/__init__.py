"""TR3 rank-sliced checkpoints (config.json `hybrid_tr3_tail`, format exl3-trellis): per_expert_v1 and
shared_h_v1, one Dialect each. Read by the local-inference-lab vLLM fork; the shared shard rules of validate
check them; repack writes them from a route pack, an exl3-v1 or another TR3 (docs/checkpoint-dialects.md).
"""

from __future__ import annotations

from typing import Any, Callable

from trellis_cli.checkpoint.declared import Declared, layer_range
from trellis_cli.checkpoint.model import DIALECT_EXL3V1, DIALECT_ROUTE_PACK, DIALECT_TR3_PER_EXPERT, DIALECT_TR3_SHARED_H
from trellis_cli.dialects.tr3.declared import Tr3Declarations, contract_of, detect_tr3
from trellis_cli.dialects.glm53.contract import DIALECT_GLM53
from trellis_cli.dialects.interface import (EXLLAMAV3, VLLM, VLLM_R7, CheckRequest, ContainerRefusal, Dialect,
                                           DialectInfo, Probe, ShardLayout)

# The rank-sliced vLLM loader that reads both rotation layouts.
NEWEST_RANK_SLICED = "vllm-exl3-shared-h"


class Tr3Dialect(Dialect):
    target = "tr3"
    shard_rules = True
    writer = "trellis_cli.dialects.tr3.write"
    declared_opening = True  # TP, layout and K per expert are all in config.json and its bitmaps
    default_engine = NEWEST_RANK_SLICED
    read_by = frozenset({VLLM, VLLM_R7})

    def __init__(self, name: str, shared_h: bool) -> None:
        self.name = name
        self.shared_h = shared_h
        self.described_as = f"a {name}"
        self.converts_from = {DIALECT_ROUTE_PACK: "route-pack-to-tr3", DIALECT_EXL3V1: "exl3-v1-to-tr3",
                              DIALECT_TR3_PER_EXPERT: "tr3-to-tr3", DIALECT_TR3_SHARED_H: "tr3-to-tr3",
                              DIALECT_GLM53: "glm53-stream-to-tr3"}
        self.drivers = {"route-pack-to-tr3": "trellis_cli.dialects.tr3.convert:route_pack_to_tr3",
                        "exl3-v1-to-tr3": "trellis_cli.dialects.exl3v1.exl3v1_to_tr3:exl3v1_to_tr3",
                        "tr3-to-tr3": "trellis_cli.dialects.tr3.convert:tr3_to_tr3",
                        "glm53-stream-to-tr3": "trellis_cli.dialects.glm53.stream:stream_to_tr3"}

    def detect(self, probe: Probe) -> DialectInfo | None:
        info = detect_tr3(probe)
        return info if info is not None and info.dialect == self.name else None

    def shard_layout(self, ckpt, layer) -> ShardLayout:
        from trellis_cli.checkpoint.declared import bits_map_overrides

        hybrid = self.rank_sliced_contract(ckpt) or {}
        overrides = bits_map_overrides(hybrid)
        note = None if layer.index not in overrides else (
            f"trellis_bits_by_layer says {overrides[layer.index]!r} for this layer where bits says "
            f"{hybrid.get('bits')!r}: the #190 and R7 loaders read bits for every layer "
            "and never the map, the shared-H loader reads the map (each profile judges the layer by its field)")
        return ShardLayout(rank_sliced=True, shared_h=self.shared_h, k_map_note=note,
                           k_declared_by="trellis_bits_by_layer's" if note else ShardLayout.k_declared_by)

    def declarations(self, ckpt, info: DialectInfo, read_json: Callable[[str], Any],
                     files: dict[str, int]) -> Declared | None:
        """The contract's K per expert (bits, trellis_bits_by_layer or the tier bitmaps it names); every layer
        of moe_layers is a MoE layer, present or not."""
        from trellis_cli.checkpoint.model import MoeLayer
        from trellis_cli.dialects.tr3.declared import k_declared

        assert isinstance(info.declared, Tr3Declarations)
        hybrid = info.declared.hybrid
        found = k_declared(hybrid, read_json, files, ckpt.count_limit)
        for layer in layer_range(hybrid.get("moe_layers"), ckpt.count_limit):
            ckpt.layers.setdefault(layer, MoeLayer(layer))
        return found

    def rank_sliced_contract(self, ckpt) -> dict[str, Any] | None:
        """config.json's hybrid_tr3_tail (detection took the checkpoint for TR3 only when it is an object)."""
        return contract_of(ckpt)

    def bit_map_problems(self, ckpt) -> list[tuple[str, Any, Any]]:
        from trellis_cli.dialects.tr3.rules import bits_map_problems

        hybrid = self.rank_sliced_contract(ckpt)
        return list(bits_map_problems(hybrid, ckpt.count_limit)) if hybrid is not None else []

    def check(self, ckpt, request: CheckRequest, report) -> None:
        """The hybrid_tr3_tail contract and its bitmaps (rules.py); the shard rules run besides."""
        from trellis_cli.dialects.tr3.rules import check_hybrid_contract

        report.extend(check_hybrid_contract(ckpt))

    def container_refusal(self, family: str) -> ContainerRefusal | None:
        if family == EXLLAMAV3:
            return ContainerRefusal("rank-sliced names", "expert tensors carry a .rank{r}. segment: exllamav3 finds "
                                    "no experts.{E}.{proj}.trellis and loads no expert",
                                    expected="experts.{E}.{proj}.trellis", found="experts.{E}.{proj}.rank{r}.trellis")
        return super().container_refusal(family)



PER_EXPERT = Tr3Dialect(DIALECT_TR3_PER_EXPERT, shared_h=False)
SHARED_H = Tr3Dialect(DIALECT_TR3_SHARED_H, shared_h=True)
