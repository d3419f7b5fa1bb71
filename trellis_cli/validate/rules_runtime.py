"""Runtime traps: checkpoints that load cleanly and then serve differently from what their owner expects.

Each finding says what the loader will do. They are warnings (or info) rather than errors: the checkpoint is
servable, but not the way a user who only ran `validate` would assume. docs/engines.md gives the sources. The
eager start of a dialect vLLM does not capture is that dialect's own rule (dialects/r7/rules.py,
dialects/exl3/rules.py).
"""

from __future__ import annotations

from typing import Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.findings import Finding, Location, Severity
from trellis_cli.header import is_int


def check_runtime(ckpt: Checkpoint, layers: list[int]) -> Iterator[Finding]:
    yield from _mtp_layers(ckpt, layers)


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
