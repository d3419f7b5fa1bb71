"""The repacked ("route pack") layout of one MoE layer on one tensor-parallel rank.

This is the contract between `trellis repack` (writer), the loader (reader) and the fused CUDA kernel:
the kernel reads these tensors as they are, with no transform at load time. docs/format.md is the
normative description; this module is its one Python mirror.

Per (layer, rank), tensors (names are the safetensors keys):

  tier{t}.trellis        int16 [E_t, 3, (H/16)*(I_r/16), 16*K_t]
        Experts of tier t in combined order. Projection p = 0 gate, 1 up, 2 down. Each projection is the
        checkpoint's own `.trellis` bytes unchanged: gate/up tiles in [kt over H/16][nt over I_r/16]
        row-major order, down tiles in [kt over I_r/16][nt over H/16] row-major order; 16*K int16 words
        per 16x16 tile (exl3-format.md §2).
  global_to_combined     int32 [E]        checkpoint expert id -> combined id, -1 = not served here
  descriptors            int32 [E_c]      by combined id: (tier << 8) | local id, -1 = skip
  tier_k                 int32 [T]        K of each tier, ascending
  tier_size              int32 [T]        experts per tier (each <= 256: local ids are 8 bits)
  rot.intermediate       float16 [E_c, 3, I_r]   gate svh | up svh | down suh, combined order
  rot.gate_suh           float16 [E_c or 1, H]   1 row when shared across experts (shared-H)
  rot.up_suh             float16 [E_c or 1, H]
  rot.down_svh           float16 [E_c or 1, H]

Combined ids are tier-ordered: tier 0's experts first (ascending checkpoint id), then tier 1's, ...
so combined id = sum(tier_size[:t]) + local id.

File metadata (safetensors __metadata__, strings): schema, schema_version, layer, rank, tp, hidden,
intermediate_rank, codebook, rotation ("per_expert" | "shared_h"), num_experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCHEMA = "trellis-route-pack"
SCHEMA_VERSION = 1
MAX_TIER_EXPERTS = 256
CODEBOOK_IDS = {"3inst": 0, "mcg": 1, "mul1": 2}


def layer_file_name(layer: int, rank: int) -> str:
    return f"layer-{layer:03d}-rank-{rank}.safetensors"


def descriptor(tier: int, local_id: int) -> int:
    return (tier << 8) | local_id


@dataclass
class LayerPack:
    """One (layer, rank) in the route-pack layout; tensors may live on CPU or on a CUDA device."""

    layer: int
    rank: int
    tp: int
    hidden: int  # H
    intermediate: int  # I_r, per rank
    codebook: str  # "3inst" | "mcg" | "mul1"
    tier_k: list[int]
    tier_trellis: list["torch.Tensor"]  # tier t: int16 [E_t, 3, (H/16)*(I_r/16), 16*K_t]
    global_to_combined: "torch.Tensor"  # int32 [E]
    descriptors: "torch.Tensor"  # int32 [E_c]
    rot_intermediate: "torch.Tensor"  # float16 [E_c, 3, I_r]
    gate_suh: "torch.Tensor"  # float16 [E_c or 1, H]
    up_suh: "torch.Tensor"
    down_svh: "torch.Tensor"

    @property
    def tier_size(self) -> list[int]:
        return [int(t.shape[0]) for t in self.tier_trellis]

    @property
    def num_combined(self) -> int:
        return sum(self.tier_size)

    @property
    def shared_h(self) -> bool:
        return self.gate_suh.shape[0] == 1 and self.num_combined > 1
