"""Plain EXL3's own rules: its quantization_config.json tensor_storage, and the eager start vLLM gives it. Run
by the exl3 dialect's `check`, beside validate's shared shard rules."""

from __future__ import annotations

from typing import Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import QUANT_CONFIG
from trellis_cli.findings import Finding, Location, error, warning


def check_tensor_storage(ckpt: Checkpoint) -> Iterator[Finding]:
    external = ckpt.quant_config
    if not isinstance(external, dict):
        return
    storage = external.get("tensor_storage")
    if storage is not None and not isinstance(storage, dict):
        yield error("config.tensor-storage", Location(file=QUANT_CONFIG, tensor="tensor_storage"),
                    "tensor_storage must be an object", found=type(storage).__name__)


def check_eager(ckpt: Checkpoint) -> Iterator[Finding]:
    """The vLLM fork lets only hybrid_tr3_tail checkpoints run with CUDA graphs; plain EXL3 runs eager."""
    yield warning("runtime.eager", Location(file="config.json", tensor="quantization_config"),
                  "plain EXL3 is not auto-detected by vLLM: it serves only with --quantization exl3 and "
                  "--enforce-eager (exl3_gemm autotunes on first use), so it runs without CUDA graphs",
                  expected="hybrid_tr3_tail for graph capture", found="quant_method exl3")
