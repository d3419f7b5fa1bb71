"""Build the bundled sample checkpoints (`python tools/sample_build.py [--pool FILE]`, from a source checkout).

The "tr3" sample is written by synth's own writer with a tensor source that hands out the golden expert
pool's real quantized tensors (each rank slice exists at K3 and K4; the bitmap picks one), so config,
bitmap, index and manifest are exactly what `trellis synth` writes. The build is deterministic: running it
again reproduces the checked-in files byte for byte.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from trellis_cli.errors import CheckFailed
from trellis_cli.sample import SAMPLE_ROOT, sample_path
from trellis_cli.synth import MCG_MARKER_VALUE, TINY_GLM_MOE_DSA, SynthSpec, write_checkpoint

DEFAULT_POOL = Path(__file__).resolve().parents[1] / "tests" / "data" / "expert_pool_small.safetensors"

# Layer 3: experts 1 and 6 at K4 (6/2); layer 4: experts 0, 3, 5, 6 at K4 (4/4). Interleaved global ids,
# and the two layers differ, as in real checkpoints.
SAMPLE_BITMAP = {3: (3, 4, 3, 3, 3, 3, 4, 3), 4: (4, 3, 3, 4, 3, 4, 4, 3)}
# A whole GLM MoE DSA model at the smallest size its model class takes (the indexer keeps its 128-wide key):
# 3 dense layers, the 2 MoE layers, every weight an engine loads besides the experts (bf16, seeded), so
# `trellis validate` on the sample checks what a loader checks and passes for a reason.
SAMPLE_MODEL = TINY_GLM_MOE_DSA | {
    "vocab_size": 256, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "index_n_heads": 1,
}
SAMPLE_SPEC = SynthSpec(hidden=256, intermediate=256, experts=8, tp=2, layers=(3, 4), bitmap=SAMPLE_BITMAP,
                        top_k=2, codebook="mcg", seed=0, model=SAMPLE_MODEL, non_expert="bf16")


def pool_key(expert: int, rank: int, proj: str, k: int, field: str) -> str:
    """Key of one tensor in the golden expert pool."""
    return f"e{expert}.r{rank}.{proj}.K{k}.{field}"


@dataclass
class PoolTensors:
    """A synth tensor source backed by the real quantized expert pool (global expert id = pool expert)."""

    pool: Path

    def linear(self, layer: int, expert: int, proj: str, rank: int, k: int) -> dict[str, torch.Tensor]:
        with safe_open(str(self.pool), "pt") as f:
            names = set(f.keys())
            tensors = {}
            for field in ("trellis", "suh", "svh"):
                key = pool_key(expert, rank, proj, k, field)
                if key not in names:
                    raise CheckFailed(f"{self.pool.name}: tensor {key} missing (needed for layer {layer})")
                tensors[field] = f.get_tensor(key)
            marker = pool_key(expert, rank, proj, k, "mcg")
            if marker not in names or int(f.get_tensor(marker)) != MCG_MARKER_VALUE:
                raise CheckFailed(f"{self.pool.name}: {marker}: expected the mcg marker 0xCBAC1FED")
        return tensors

    def shared_h(self, layer: int, proj: str, rank: int) -> torch.Tensor:
        raise CheckFailed("the expert pool has per-expert hidden-side vectors; it cannot fill a shared_h_v1 layout")


def build(pool: Path = DEFAULT_POOL, root: Path = SAMPLE_ROOT) -> list[Path]:
    """Write every sample variant under `root`; returns their directories."""
    if not pool.is_file():
        raise CheckFailed(f"{pool}: expert pool not found (it lives in tests/data of the source tree)")
    real = write_checkpoint(root / sample_path("tr3").name, SAMPLE_SPEC, source=PoolTensors(pool), overwrite=True)
    shared = write_checkpoint(root / sample_path("tr3-shared-h").name,
                              replace(SAMPLE_SPEC, rotation_layout="shared_h_v1"), overwrite=True)
    return [real, shared]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tools/sample_build.py", description=__doc__.splitlines()[0])
    parser.add_argument("--pool", type=Path, default=DEFAULT_POOL, help="expert_pool_small.safetensors")
    parser.add_argument("--out", type=Path, default=SAMPLE_ROOT, help="where to write the variants")
    args = parser.parse_args(argv)
    for path in build(args.pool, args.out):
        print(path)


if __name__ == "__main__":
    main()
