"""R7 checkpoints: per-projection K maps in `r7_routed_experts` of the quantization config, hidden-side
vectors once per layer (experts.r7_shared). Recognized, inspected and checked by the shared shard rules; read
by the fork's R7 loader version (its default profile, vllm-exl3-r7) and by exllamav3 where its vectors sit under
every linear (docs/checkpoint-dialects.md).
"""

from __future__ import annotations

from typing import Any, Callable

from trellis_cli.checkpoint.declared import Declared
from trellis_cli.checkpoint.model import DIALECT_R7
from trellis_cli.dialects.r7.declared import R7Declarations, detect_r7
from trellis_cli.dialects.interface import (EXLLAMAV3, VLLM, VLLM_R7, CheckRequest, Dialect, DialectInfo, Probe,
                                           ShardLayout)


# The fork's R7 loader takes each tensor's K from its trellis shape and never opens bit_map_manifests (stored
# version of 212,886 chars: no reader of that key); exllamav3 reads K from the shapes too.
R7_MAPS_UNREAD = ("the R7 loader reads each K from the trellis shape and never reads the bit maps, so it loads "
                  "what is stored")


class R7Dialect(Dialect):
    name = DIALECT_R7
    described_as = "an R7 (r7_routed_experts)"
    shard_rules = True
    streamed_k_maps = True  # r7_routed_experts: the R7 version's per-projection K maps
    tp_from_rank_ids = True
    default_engine = "vllm-exl3-r7"  # the fork's R7 loader version (validate/engine_r7.py)
    read_by = frozenset({EXLLAMAV3, VLLM_R7})
    container_notes = {VLLM: "r7_routed_experts is not a contract this version reads (it knows hybrid_tr3_tail "
                               "and tensor_storage only)"}

    def detect(self, probe: Probe) -> DialectInfo | None:
        return detect_r7(probe)

    def declarations(self, ckpt, info: DialectInfo, read_json: Callable[[str], Any],
                     files: dict[str, int]) -> Declared | None:
        """Its per-layer bit maps (r7_routed_experts)."""
        from trellis_cli.dialects.r7.declared import k_declared

        assert isinstance(info.declared, R7Declarations)
        return k_declared(info.declared.routed_experts, read_json, files)

    def shard_layout(self, ckpt, layer) -> ShardLayout:
        return ShardLayout(r7_shared=bool(layer.r7_shared), k_declared_by="the R7 bit map", k_map_note=R7_MAPS_UNREAD)

    def check(self, ckpt, request: CheckRequest, report) -> None:
        """Its K maps and the eager start its metadata gets (rules.py); the shard rules run besides."""
        from trellis_cli.dialects.r7.rules import check_eager, check_r7_maps

        report.extend(check_r7_maps(ckpt))
        report.extend(check_eager(ckpt))


DIALECT = R7Dialect()
