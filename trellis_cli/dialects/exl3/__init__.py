"""Plain exllamav3 checkpoints (quant_method "exl3"): per-linear expert tensors, no rank slices. Read by
exllamav3 and by the vLLM fork through tensor_storage; checked by the shared shard rules.
"""

from __future__ import annotations

from typing import Any, Callable

from trellis_cli.checkpoint.declared import Declared
from trellis_cli.checkpoint.model import DIALECT_EXL3
from trellis_cli.dialects.exl3.declared import detect_exl3
from trellis_cli.dialects.interface import (EXLLAMAV3, VLLM, VLLM_R7, CheckRequest, Dialect, DialectInfo, Probe,
                                           ShardLayout)


class Exl3Dialect(Dialect):
    name = DIALECT_EXL3
    described_as = "a plain exllamav3"
    shard_rules = True
    module_records = True  # the fork's generic EXL3 path: tensor_storage
    tp_from_rank_ids = True
    default_engine = "exllamav3"
    read_by = frozenset({VLLM, VLLM_R7, EXLLAMAV3})

    def detect(self, probe: Probe) -> DialectInfo | None:
        return detect_exl3(probe)

    def declarations(self, ckpt, info: DialectInfo, read_json: Callable[[str], Any],
                     files: dict[str, int]) -> Declared | None:
        """Per-projection K from tensor_storage's bits_per_weight."""
        from trellis_cli.dialects.exl3.declared import k_declared

        return k_declared(ckpt.quant_config)

    def shard_layout(self, ckpt, layer) -> ShardLayout:
        return ShardLayout(k_declared_by="tensor_storage")

    def check(self, ckpt, request: CheckRequest, report) -> None:
        """Its tensor_storage and the eager start vLLM gives it (rules.py); the shard rules run besides."""
        from trellis_cli.dialects.exl3.rules import check_eager, check_tensor_storage

        report.extend(check_tensor_storage(ckpt))
        report.extend(check_eager(ckpt))


DIALECT = Exl3Dialect()
