"""The LayerPack: one MoE layer on one tensor-parallel rank as the fused kernel reads it.

This is the contract between every packer (a dialect's `layer_pack`, a route pack's layer file), the float64
reference and the fused CUDA kernel: the kernel reads these tensors as they are, with no transform at load time.
A route pack (dialects/routepack/) stores one LayerPack per file. docs/format.md is the normative description;
this module is its one Python mirror.

Per (layer, rank), tensors (names are the safetensors keys of a route-pack layer file):

  tier{t}.trellis        int16 [E_t, 3, (H/16)*(I_r/16), 16*K_t]
        Experts of tier t in combined order. Projection p = 0 gate, 1 up, 2 down. Each projection is the
        checkpoint's own `.trellis` bytes unchanged: gate/up tiles in [kt over H/16][nt over I_r/16]
        row-major order, down tiles in [kt over I_r/16][nt over H/16] row-major order; 16*K int16 words
        per 16x16 tile (docs/exl3-format.md §2).
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

A route-pack layer file's metadata is dialects/routepack/layer_file.py `file_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trellis_cli.codebooks import IDS as CODEBOOK_IDS  # noqa: F401  (the route pack's codebook ids)

if TYPE_CHECKING:
    import torch

MAX_TIER_EXPERTS = 256
ROTATIONS = ("per_expert", "shared_h")

# Tensor names (safetensors keys) inside one layer file; slabs first, so each starts 8-byte aligned.
GLOBAL_TO_COMBINED = "global_to_combined"
DESCRIPTORS = "descriptors"
TIER_K = "tier_k"
TIER_SIZE = "tier_size"
ROT_INTERMEDIATE = "rot.intermediate"
ROT_GATE_SUH = "rot.gate_suh"
ROT_UP_SUH = "rot.up_suh"
ROT_DOWN_SVH = "rot.down_svh"
TABLE_NAMES = (GLOBAL_TO_COMBINED, DESCRIPTORS, TIER_K, TIER_SIZE, ROT_INTERMEDIATE, ROT_GATE_SUH, ROT_UP_SUH,
               ROT_DOWN_SVH)


def tier_trellis_name(tier: int) -> str:
    return f"tier{tier}.trellis"


def tiles_per_projection(hidden: int, intermediate: int) -> int:
    """16x16 tiles in one projection of one expert on one rank: (H/16)*(I_r/16), the same for gate, up, down."""
    return (hidden // 16) * (intermediate // 16)


def tier_trellis_shape(num_experts: int, hidden: int, intermediate: int, k: int) -> tuple[int, int, int, int]:
    return (num_experts, 3, tiles_per_projection(hidden, intermediate), 16 * k)


def split_descriptor(value: "int | torch.Tensor") -> "tuple[int, int] | tuple[torch.Tensor, torch.Tensor]":
    """(tier, local id) of a descriptor, or elementwise of an integer tensor of them; callers check for -1
    (skip) first."""
    return value >> 8, value & 0xFF  # type: ignore[return-value]  # an int in, ints out; a tensor, tensors


def descriptor(tier: int, local_id: int) -> int:
    return (tier << 8) | local_id


@dataclass
class LayerPack:
    """One (layer, rank) in the kernel's layout; tensors may live on CPU or on a CUDA device."""

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

    @property
    def rotation(self) -> str:
        return "shared_h" if self.shared_h else "per_expert"

    def tensors(self) -> "dict[str, torch.Tensor]":
        """Every tensor of the layer file, keyed by its safetensors name, in file order."""
        import torch

        out = {tier_trellis_name(t): slab for t, slab in enumerate(self.tier_trellis)}
        out[GLOBAL_TO_COMBINED] = self.global_to_combined
        out[DESCRIPTORS] = self.descriptors
        out[TIER_K] = torch.tensor(self.tier_k, dtype=torch.int32)
        out[TIER_SIZE] = torch.tensor(self.tier_size, dtype=torch.int32)
        out[ROT_INTERMEDIATE] = self.rot_intermediate
        out[ROT_GATE_SUH] = self.gate_suh
        out[ROT_UP_SUH] = self.up_suh
        out[ROT_DOWN_SVH] = self.down_svh
        return out

    def served_experts(self, tier: int) -> list[int]:
        """Checkpoint expert ids of one tier, in local-id order (ascending)."""
        g2c = self.global_to_combined.tolist()
        start = sum(self.tier_size[:tier])
        by_combined = {c: g for g, c in enumerate(g2c) if c >= 0}
        return [by_combined[c] for c in range(start, start + self.tier_size[tier])]
