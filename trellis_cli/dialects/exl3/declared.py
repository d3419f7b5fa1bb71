"""What a plain exllamav3 checkpoint declares: quant_method "exl3" in the embedded or external quantization
config (detection), and K per (expert, projection) from `tensor_storage` (bits_per_weight per module).
"""

from __future__ import annotations

from typing import Any

from trellis_cli.checkpoint.declared import Declared, is_integral
from trellis_cli.checkpoint.model import DIALECT_EXL3
from trellis_cli.checkpoint.names import parse_expert_name
from trellis_cli.dialects.interface import DialectInfo, Probe


def detect_exl3(probe: Probe) -> DialectInfo | None:
    if probe.config is None or "exl3" not in probe.quant_methods():
        return None
    return DialectInfo(DIALECT_EXL3, "n/a", 1, probe.quant_codebook())


def k_declared(quant_config: dict[str, Any] | None) -> Declared:
    """Per-projection K from quantization_config.json tensor_storage (bits_per_weight per module)."""
    out = Declared()
    storage = (quant_config or {}).get("tensor_storage")
    if not isinstance(storage, dict):
        return out
    for module, record in storage.items():
        if not isinstance(record, dict) or record.get("quant_format") != "exl3":
            continue
        parsed = parse_expert_name(f"{module}.trellis")
        if parsed is None or parsed.kind != "linear" or not is_integral(record.get("bits_per_weight")):
            continue
        assert parsed.expert is not None and parsed.projection is not None  # the linear grammar names both
        out.projection_k.setdefault(parsed.layer, {})[(parsed.expert, parsed.projection)] = int(
            record["bits_per_weight"])
    return out
