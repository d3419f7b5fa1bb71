"""The bundled sample checkpoints: tiny TR3 checkpoints shipped inside the package.

Used as the default source when a command is given none, so the tool works with no download.
- "tr3" (default): real quantized experts (from the golden expert pool, exllamav3's own quantizer, mcg):
  per_expert_v1, hidden 256, intermediate 256 at TP2, 8 experts, MoE layers 3-4 with different K3/K4
  partitions (layer 3: 6/2, layer 4: 4/4, interleaved global ids).
- "tr3-shared-h": the same geometry and partitions in the shared_h_v1 layout. Synthetic (seeded random
  codes): real per-expert quantization gives per-expert hidden-side vectors, so shared-H cannot be real here.
Rebuild with `python tools/sample_build.py` (a source checkout's builder, not in the package). Importing this module does not import torch.
"""

from __future__ import annotations

from pathlib import Path

from trellis_cli.errors import UsageError

DEFAULT_VARIANT = "tr3"
VARIANTS: dict[str, str] = {
    "tr3": "real quantized experts, per_expert_v1, 8 experts, TP2, layers 3-4 (K3/K4 6/2 and 4/4)",
    "tr3-shared-h": "synthetic, shared_h_v1, same geometry and partitions as tr3",
}
SAMPLE_ROOT = Path(__file__).resolve().parent


def sample_path(variant: str = DEFAULT_VARIANT) -> Path:
    """The directory of one bundled sample checkpoint."""
    if variant not in VARIANTS:
        raise UsageError(f"unknown sample variant {variant!r} (known: {', '.join(VARIANTS)})")
    return SAMPLE_ROOT / variant


__all__ = ["DEFAULT_VARIANT", "VARIANTS", "sample_path"]
