"""Synthetic route packs at production geometry, built directly on the GPU, and random routes.

Every bit pattern is a valid trellis (docs/exl3-format.md §2.3), so random int16 codes are a faithful stand-in
for real weights as far as speed and the oracle are concerned. Rotation scales are chosen so that every
intermediate stays O(1) (decoded weights have RMS ~1.24 and H128 is orthonormal), like a real layer.
Tier membership is a seeded random subset of global ids, so K3 and K4 experts interleave as in the
published checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from trellis_cli.errors import UsageError
from trellis_cli.formats.layer_pack import LayerPack, descriptor

CODEBOOK_RMS = 1.24
RANK_SEED_STRIDE = 1_000_003  # rank r's weights are drawn from seed + r * stride


@dataclass(frozen=True)
class Preset:
    name: str
    hidden: int
    intermediate: int  # per rank
    experts: int
    top_k: int
    codebook: str
    partition: tuple[int, ...]  # experts per tier, ascending K
    tier_k: tuple[int, ...]
    tp: int
    shared_h: bool = False  # one gate suh, up suh and down svh row for every expert (format.md, shared-H)


GLM52_TP4 = Preset("glm52-tp4", 6144, 512, 256, 8, "mcg", (192, 64), (3, 4), 4)
PRESETS = {
    GLM52_TP4.name: GLM52_TP4,
    "glm52-tp4-shared-h": dataclasses.replace(GLM52_TP4, name="glm52-tp4-shared-h", shared_h=True),
    # The same layer with its K4 tier at K5 (R7 v2 checkpoints carry K5): served by the all-K kernels.
    "glm52-tp4-k3k5": dataclasses.replace(GLM52_TP4, name="glm52-tp4-k3k5", tier_k=(3, 5)),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise UsageError(f"unknown synthetic preset {name!r}: known presets are {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def parse_partition(text: str, tiers: int) -> tuple[int, ...]:
    """'192/64' -> (192, 64) for a preset of `tiers` tiers (selection.parse_partition, the one reader)."""
    from trellis_cli.selection import parse_partition as parse

    return parse(text, tiers)


def synthetic_pack(preset: Preset, partition: tuple[int, ...] | None = None, tier_k: tuple[int, ...] | None = None,
                   *, device: torch.device | str = "cuda", seed: int = 0, codebook: str | None = None,
                   rank: int = 0) -> LayerPack:
    """A random LayerPack of the preset's geometry; tiers with zero experts are dropped.

    `rank` picks one tensor-parallel rank's slice: which experts are in which tier follows `seed` alone
    (an expert has one K on every rank), its weights follow `seed` and `rank`."""
    partition = partition or preset.partition
    tier_k = tier_k or preset.tier_k
    if sum(partition) != preset.experts:
        raise UsageError(f"partition {partition} must add up to {preset.experts} experts")
    kept = [(n, k) for n, k in zip(partition, tier_k) if n > 0]
    gen = torch.Generator(device=device).manual_seed(seed + RANK_SEED_STRIDE * rank)
    cpu_gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(preset.experts, generator=cpu_gen)
    hidden, inter = preset.hidden, preset.intermediate
    tiles = (hidden // 16) * (inter // 16)
    g2c = torch.full((preset.experts,), -1, dtype=torch.int32)
    descriptors: list[int] = []
    trellis: list[torch.Tensor] = []
    start = 0
    for tier, (count, k) in enumerate(kept):
        members = torch.sort(order[start:start + count]).values
        start += count
        base = len(descriptors)
        for local, expert in enumerate(members.tolist()):
            g2c[expert] = base + local
            descriptors.append(descriptor(tier, local))
        trellis.append(torch.randint(-32768, 32768, (count, 3, tiles, 16 * k), dtype=torch.int16,
                                     device=device, generator=gen))
    combined = len(descriptors)
    hidden_scale = 1.0 / (CODEBOOK_RMS * math.sqrt(hidden))
    inter_scale = 1.0 / (CODEBOOK_RMS * math.sqrt(inter))
    rot = torch.stack([_scales((combined, inter), 1.0, gen, device), _scales((combined, inter), 1.0, gen, device),
                       _scales((combined, inter), inter_scale, gen, device)], dim=1)
    h_rows = 1 if preset.shared_h else combined
    return LayerPack(
        layer=0, rank=rank, tp=preset.tp, hidden=hidden, intermediate=inter, codebook=codebook or preset.codebook,
        tier_k=[k for _, k in kept], tier_trellis=trellis, global_to_combined=g2c.to(device),
        descriptors=torch.tensor(descriptors, dtype=torch.int32, device=device), rot_intermediate=rot.contiguous(),
        gate_suh=_scales((h_rows, hidden), hidden_scale, gen, device),
        up_suh=_scales((h_rows, hidden), hidden_scale, gen, device),
        down_svh=_scales((h_rows, hidden), 1.0, gen, device),
    )


def _scales(shape: tuple[int, int], scale: float, gen: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """Random signs times a magnitude in [0.875, 1.125]·scale, fp16 (how a quantizer's suh/svh look)."""
    sign = torch.randint(0, 2, shape, generator=gen, device=device).float() * 2 - 1
    mag = torch.rand(shape, generator=gen, device=device) * 0.25 + 0.875
    return (sign * mag * scale).to(torch.float16)


def random_routes(m: int, num_experts: int, top_k: int, *, device: torch.device | str,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct top-k expert ids per token (int32) and softmax router weights (fp32)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand((m, num_experts), generator=gen, device=device)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32).contiguous()
    logits = torch.randn((m, top_k), generator=gen, device=device)
    return ids, torch.softmax(logits, dim=1).float().contiguous()


def random_activations(m: int, hidden: int, *, device: torch.device | str, seed: int,
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((m, hidden), generator=gen, device=device).to(dtype).contiguous()


def clone_weights(pack: LayerPack) -> LayerPack:
    """A copy of the pack in fresh memory (cold-L2 benchmarking cycles through such copies)."""
    return LayerPack(
        layer=pack.layer, rank=pack.rank, tp=pack.tp, hidden=pack.hidden, intermediate=pack.intermediate,
        codebook=pack.codebook, tier_k=list(pack.tier_k), tier_trellis=[t.clone() for t in pack.tier_trellis],
        global_to_combined=pack.global_to_combined.clone(), descriptors=pack.descriptors.clone(),
        rot_intermediate=pack.rot_intermediate.clone(), gate_suh=pack.gate_suh.clone(), up_suh=pack.up_suh.clone(),
        down_svh=pack.down_svh.clone(),
    )
