"""Runtime traps: checkpoints that load cleanly and then serve differently from what their owner expects.

Each finding says what the loader will do. They are warnings (or info) rather than errors: the checkpoint is
servable, but not the way a user who only ran `validate` would assume. docs/engines.md gives the sources.
"""

from __future__ import annotations

from typing import Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import Finding, Location, Severity, warning
from trellis_cli.header import is_int


def check_runtime(ckpt: Checkpoint, layers: list[int]) -> Iterator[Finding]:
    yield from _eager(ckpt)
    yield from _mtp_layers(ckpt, layers)


def _eager(ckpt: Checkpoint) -> Iterator[Finding]:
    """The vLLM fork lets only hybrid_tr3_tail checkpoints run with CUDA graphs; every other EXL3 one is eager."""
    dialect = dialect_of(ckpt)
    if dialect.r7_maps:
        yield warning("runtime.eager", Location(file="config.json", tensor="quantization_config.r7_routed_experts"),
                      "R7 metadata is not the hybrid_tr3_tail contract that vLLM's EXL3 loader exempts from its "
                      "eager check: without a build that adds r7_routed_experts to that exemption the server "
                      "runs eager (no CUDA graph capture, several times slower decode) and says nothing",
                      expected="hybrid_tr3_tail (format exl3-trellis)", found="r7_routed_experts")
    elif dialect.tensor_storage:
        yield warning("runtime.eager", Location(file="config.json", tensor="quantization_config"),
                      "plain EXL3 is not auto-detected by vLLM: it serves only with --quantization exl3 and "
                      "--enforce-eager (exl3_gemm autotunes on first use), so it runs without CUDA graphs",
                      expected="hybrid_tr3_tail for graph capture", found="quant_method exl3")


def _mtp_layers(ckpt: Checkpoint, layers: list[int]) -> Iterator[Finding]:
    """A MoE layer at index >= num_hidden_layers is the MTP (next-token draft) head, e.g. GLM-5.2's layer 78."""
    decoder_layers = ckpt.config.get("num_hidden_layers")
    if not is_int(decoder_layers):
        return
    for li in layers:
        if li >= decoder_layers:
            yield Finding("runtime.mtp-layer", Severity.INFO, Location(layer=li), "this layer is past the "
                          f"{decoder_layers} decoder layers: the MTP/draft head. vLLM builds it as a separate draft "
                          "model, loaded only with MTP speculative decoding; its moe_layers bitmap entry is still "
                          "checked at load (the shared-H loader wants the full K field and every declared K)",
                          expected=f"< {decoder_layers} for a decoder layer", found=li)
