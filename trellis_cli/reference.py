"""Reference MoE forward: the oracle the fused CUDA kernel is held to.

Built on codec.effective_weight only, in float64 by default (float32 on request), on whatever device the
inputs live on. Experts are decoded one at a time and only when routed, so a production layer (H=6144,
I_r=512, 256 experts) fits on one GPU in float64.

A projection is a (trellis, suh, svh) triple of one tensor-parallel rank slice. For a rank whose
intermediate dim is I_r: gate/up are [H, I_r] (output-sliced), down is [I_r, H] (input-sliced), so the
expert output of one rank is a partial sum; summing over ranks gives the full expert.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from trellis_cli.codec import effective_weight
from trellis_cli.errors import CheckFailed
from trellis_cli.formats.layer_pack import split_descriptor

if TYPE_CHECKING:
    from trellis_cli.formats.layer_pack import LayerPack

Projection = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (trellis, suh, svh)
Expert = tuple[Projection, Projection, Projection]  # (gate, up, down)
ExpertCall = tuple[Projection, Projection, Projection, str]  # expert_forward's (gate, up, down, codebook)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise CheckFailed(f"reference: dtype must be float32 or float64, found {dtype}")


def expert_forward(
    x: torch.Tensor,
    gate: Projection,
    up: Projection,
    down: Projection,
    codebook: str,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """y = (SiLU(x·Wg) * (x·Wu)) · Wd for x [..., H]; a rank-partial output when down is input-sliced."""
    _check_dtype(dtype)
    xd = x.to(dtype)
    gate_out = xd @ effective_weight(*gate, codebook, dtype=dtype)
    up_out = xd @ effective_weight(*up, codebook, dtype=dtype)
    return (F.silu(gate_out) * up_out) @ effective_weight(*down, codebook, dtype=dtype)


def _check_routes(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
    if x.dim() != 2:
        raise CheckFailed(f"x: expected [tokens, hidden], found shape {list(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype.is_floating_point:
        raise CheckFailed(
            f"topk_ids: expected integer [{x.shape[0]}, k], found {topk_ids.dtype} {list(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise CheckFailed(
            f"topk_weights: expected shape {list(topk_ids.shape)}, found {list(topk_weights.shape)}"
        )


def _routed_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    dtype: torch.dtype,
    expert_for: Callable[[int], ExpertCall | None],
) -> torch.Tensor:
    """Σ_k w[t,k]·expert(x[t]) with `expert_for(global id)` giving the expert or None (contributes zero)."""
    _check_dtype(dtype)
    _check_routes(x, topk_ids, topk_weights)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for expert_id in torch.unique(topk_ids).tolist():
        expert = expert_for(int(expert_id))
        if expert is None:
            continue
        rows, slots = torch.nonzero(topk_ids == expert_id, as_tuple=True)
        y = expert_forward(x[rows], *expert, dtype=dtype)
        out.index_add_(0, rows, y * topk_weights[rows, slots].to(dtype)[:, None])
    return out


def moe_forward(
    x: torch.Tensor,
    experts: Mapping[int, Expert],
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    codebook: str,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """out[t] = Σ_k topk_weights[t,k] · expert_forward(x[t]) over experts[topk_ids[t,k]]; x is [M, H].

    Ids missing from `experts` (not served by this rank) contribute zero.
    """

    def expert_for(expert_id: int) -> ExpertCall | None:
        expert = experts.get(expert_id)
        return None if expert is None else (*expert, codebook)

    return _routed_forward(x, topk_ids, topk_weights, dtype, expert_for)


def pack_expert(pack: "LayerPack", combined_id: int) -> Expert:
    """The (gate, up, down) triples of one expert of a route pack, as views of the pack's tensors."""
    descriptor = int(pack.descriptors[combined_id])
    tier, local = split_descriptor(descriptor)
    hidden_tiles, inter_tiles = pack.hidden // 16, pack.intermediate // 16
    trellis = pack.tier_trellis[tier][local]
    words = int(trellis.shape[-1])
    rot = pack.rot_intermediate[combined_id]

    def shared_row(table: torch.Tensor) -> torch.Tensor:
        return table[0 if table.shape[0] == 1 else combined_id]

    gate = (trellis[0].reshape(hidden_tiles, inter_tiles, words), shared_row(pack.gate_suh), rot[0])
    up = (trellis[1].reshape(hidden_tiles, inter_tiles, words), shared_row(pack.up_suh), rot[1])
    down = (trellis[2].reshape(inter_tiles, hidden_tiles, words), rot[2], shared_row(pack.down_svh))
    return gate, up, down


def layer_pack_forward(
    pack: "LayerPack",
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """moe_forward computed from the route-pack layout of one (layer, rank): the rank-partial output.

    Experts whose global_to_combined entry or descriptor is -1 are not served here and contribute zero.
    """
    num_experts = int(pack.global_to_combined.shape[0])

    def expert_for(expert_id: int) -> ExpertCall | None:
        if not 0 <= expert_id < num_experts:
            raise CheckFailed(f"topk_ids: expert id {expert_id} outside 0..{num_experts - 1}")
        combined = int(pack.global_to_combined[expert_id])
        if combined < 0 or int(pack.descriptors[combined]) < 0:
            return None
        return (*pack_expert(pack, combined), pack.codebook)

    return _routed_forward(x, topk_ids, topk_weights, dtype, expert_for)
