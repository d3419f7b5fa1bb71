"""Gather one (layer, rank) of a checkpoint stored as per-linear safetensors shards (TR3 and the other shard
dialects) into the kernel's LayerPack (`pack_layer`): the `Dialect.layer_pack` default, and what a route pack's
layer file holds.

Tiers are the layer's distinct K values, ascending; combined ids are tier-ordered with ascending checkpoint
id inside a tier (formats/layer_pack.py). Trellis bytes are moved unchanged. Rotation vectors are gathered in combined
order; hidden-side rows collapse to one [1, H] row under shared-H. With a target TP different from the
source's, each projection is re-sliced along the intermediate dimension (tp_reslice.rank_pieces), exactly or not
at all. The `expected_*` functions are also what verification compares the written file against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, LinearRef, MoeLayer, TensorRef
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.formats.layer_pack import MAX_TIER_EXPERTS, LayerPack, descriptor, tier_trellis_shape
from trellis_cli.dialects.tp_reslice import Piece, is_identity, rank_pieces, resolve_target_tp
from trellis_cli.checkpoint.tensor_bytes import TensorReader

if TYPE_CHECKING:
    import torch

# Hidden-side vector of each projection: gate/up read the hidden state (input side, suh), down writes it (svh).
HIDDEN_SIDE = {"gate_proj": "suh", "up_proj": "suh", "down_proj": "svh"}
INTERMEDIATE_SIDE = {"gate_proj": "svh", "up_proj": "svh", "down_proj": "suh"}


class Arena:
    """Reused memory for slabs. A repack worker packs one layer-rank after another; writing into the same
    pages each time avoids faulting in ~1 GB of fresh memory per layer-rank (measured 5x the read cost).
    A pack built in an arena is valid until the arena's next `reset`."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.used = 0

    def reset(self, nbytes: int) -> None:
        import torch

        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = None  # free the old pages before taking the new ones
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.used = 0

    def take(self, shape: tuple[int, ...]) -> "torch.Tensor":
        """An int16 tensor of `shape` carved from the buffer."""
        import torch

        nbytes = 2 * _prod(shape)
        assert self.buffer is not None, "Arena.take before reset"
        view = self.buffer[self.used:self.used + nbytes]
        self.used += nbytes
        return view.view(torch.int16).view(shape)


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def source_is_shared_h(checkpoint: Checkpoint) -> bool:
    """Whether the source stores one hidden-side row per (projection, rank) instead of one per expert."""
    return checkpoint.rotation_layout == "shared_h_v1"  # a shared_h_v1 TR3 checkpoint's layout, always


def layer_tiers(checkpoint: Checkpoint, layer: int) -> list[tuple[int, list[int]]]:
    """[(K, ascending expert ids)] by ascending K; every expert must have one K over projections and ranks."""
    moe = _moe(checkpoint, layer)
    tiers: dict[int, list[int]] = {}
    for expert in sorted(moe.experts):
        k = moe.expert_k(expert)
        if k is None:
            raise CheckFailed(f"layer {layer}: expert {expert} has no single K across projections and ranks")
        tiers.setdefault(k, []).append(expert)
    for k, ids in tiers.items():
        if len(ids) > MAX_TIER_EXPERTS:
            raise CheckFailed(f"layer {layer}: tier K{k} has {len(ids)} experts, more than the "
                              f"{MAX_TIER_EXPERTS} an 8-bit local id can address")
    return sorted(tiers.items())


def _moe(checkpoint: Checkpoint, layer: int) -> MoeLayer:
    if layer not in checkpoint.layers:
        raise UsageError(f"layer {layer} is not a MoE layer of the source")
    return checkpoint.layers[layer]


def linear_slice(moe: MoeLayer, expert: int, proj: str, rank: int) -> LinearRef:
    try:
        lin = moe.experts[expert][proj][rank]
    except KeyError:
        raise CheckFailed(f"layer {moe.index}: expert {expert} {proj} has no rank {rank} slice") from None
    if lin.trellis is None:
        raise CheckFailed(f"{lin.prefix}.trellis: missing")
    return lin


def _trellis(lin: LinearRef) -> TensorRef:
    """The trellis of a linear `linear_slice` returned (it refuses one without)."""
    assert lin.trellis is not None
    return lin.trellis


def vector_ref(moe: MoeLayer, lin: LinearRef, proj: str, rank: int, side: str, shared: bool) -> TensorRef:
    if shared and side == HIDDEN_SIDE[proj]:
        ref = moe.shared_h.get((proj, rank), {}).get(side)
        name = f"layer {moe.index} shared_h {proj} rank {rank} {side}"
    else:
        ref = getattr(lin, side)
        name = f"{lin.prefix}.{side}"
    if ref is None:
        raise CheckFailed(f"{name}: missing")
    if ref.dtype != "F16":
        raise CheckFailed(f"{name}: dtype {ref.dtype}, expected F16")
    return ref


def _read_vector(reader: TensorReader, ref: TensorRef, length: int) -> "torch.Tensor":
    vec = reader.read(ref).reshape(-1)
    if vec.numel() != length:
        raise CheckFailed(f"{ref.file}: {ref.name}: {vec.numel()} elements, expected {length}")
    return vec


def expected_trellis(reader: TensorReader, moe: MoeLayer, expert: int, proj: str, pieces: list[Piece],
                     hidden: int, source_width: int) -> "torch.Tensor":
    """The re-sliced trellis of one projection as int16 [tiles, 16K] (gate/up sliced on N, down on K)."""
    import torch

    parts = []
    for piece in pieces:
        lin = linear_slice(moe, expert, proj, piece.source_rank)
        rows, cols = (hidden // 16, source_width // 16) if proj != "down_proj" else (source_width // 16, hidden // 16)
        trellis = _trellis(lin)
        shape = tuple(trellis.shape)
        if trellis.dtype != "I16" or len(shape) != 3 or shape[:2] != (rows, cols) or shape[2] % 16:
            raise CheckFailed(f"{lin.prefix}.trellis: {trellis.dtype} {list(shape)}, expected I16 "
                              f"[{rows}, {cols}, 16*K]")
        full = reader.read(trellis)
        lo, hi = piece.lo // 16, piece.hi // 16
        parts.append(full[:, lo:hi] if proj != "down_proj" else full[lo:hi])
    dim = 1 if proj != "down_proj" else 0
    whole = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return whole.reshape(-1, whole.shape[-1])


def expected_intermediate(reader: TensorReader, moe: MoeLayer, expert: int, proj: str, pieces: list[Piece],
                          source_width: int, shared: bool) -> "torch.Tensor":
    """gate svh / up svh / down suh of the target rank, [I_r] float16."""
    import torch

    side = INTERMEDIATE_SIDE[proj]
    parts = []
    for piece in pieces:
        lin = linear_slice(moe, expert, proj, piece.source_rank)
        vec = _read_vector(reader, vector_ref(moe, lin, proj, piece.source_rank, side, shared), source_width)
        parts.append(vec[piece.lo:piece.hi])
    return parts[0].clone() if len(parts) == 1 else torch.cat(parts)


def expected_hidden(reader: TensorReader, moe: MoeLayer, expert: int, proj: str, pieces: list[Piece],
                    hidden: int, shared: bool) -> "torch.Tensor":
    """gate suh / up suh / down svh of the target rank, [H] float16; merged ranks must agree byte for byte."""
    import torch

    side = HIDDEN_SIDE[proj]
    first: torch.Tensor | None = None
    for piece in pieces:
        lin = linear_slice(moe, expert, proj, piece.source_rank)
        vec = _read_vector(reader, vector_ref(moe, lin, proj, piece.source_rank, side, shared), hidden)
        if first is None:
            first = vec
        elif not torch.equal(first.view(torch.int16), vec.view(torch.int16)):
            raise CheckFailed(
                f"layer {moe.index}: expert {expert} {proj} {side} differs between rank {pieces[0].source_rank} "
                f"and rank {piece.source_rank}: these rank slices were quantized separately, so merging them "
                f"is not exact (refused)"
            )
    assert first is not None  # rank_pieces gives every target rank at least one piece
    return first


def pack_layer(checkpoint: Checkpoint, layer: int, rank: int, *, device: str = "cpu", tp: int | None = None,
               shared_h: bool | None = None, reader: TensorReader | None = None,
               arena: Arena | None = None) -> LayerPack:
    """One (layer, rank) in the route-pack layout. `tp` re-slices (exact cases only); `shared_h=True`
    collapses hidden-side rows to [1, H] (refused unless byte-equal), None keeps the source's layout."""
    if checkpoint.hidden is None or checkpoint.intermediate is None:
        raise CheckFailed("the source declares no hidden or intermediate size")
    own_reader = reader is None
    reader = reader or TensorReader(checkpoint.source)
    try:
        pack = _pack(checkpoint, layer, rank, resolve_target_tp(tp, checkpoint.tp), shared_h, reader, arena)
    finally:
        if own_reader:
            reader.close()
    return pack if str(device) == "cpu" else to_device(pack, device)


def _pack(checkpoint: Checkpoint, layer: int, rank: int, target_tp: int, shared_h: bool | None,
          reader: TensorReader, arena: Arena | None) -> LayerPack:
    import torch

    moe = _moe(checkpoint, layer)
    hidden, inter = checkpoint.moe_sizes()
    if not 0 <= rank < target_tp:
        raise UsageError(f"rank {rank} is outside 0..{target_tp - 1}")
    source_width, width = inter // checkpoint.tp, inter // target_tp
    pieces = rank_pieces(inter, checkpoint.tp, target_tp, rank)
    source_shared = source_is_shared_h(checkpoint)
    tiers = layer_tiers(checkpoint, layer)
    num_experts = checkpoint.num_experts or (max(moe.experts) + 1)
    served = sum(len(ids) for _, ids in tiers)

    global_to_combined = torch.full((num_experts,), -1, dtype=torch.int32)
    descriptors = torch.empty(served, dtype=torch.int32)
    rot_intermediate = torch.empty((served, 3, width), dtype=torch.float16)
    hidden_rows = torch.empty((3, served, hidden), dtype=torch.float16)
    slabs, codebooks = [], set()
    shapes = [tier_trellis_shape(len(ids), hidden, width, k) for k, ids in tiers]
    if arena is not None:
        arena.reset(sum(2 * _prod(shape) for shape in shapes))
    combined = 0
    for tier, (k, ids) in enumerate(tiers):
        slab = arena.take(shapes[tier]) if arena is not None else torch.empty(shapes[tier], dtype=torch.int16)
        for local, expert in enumerate(ids):
            if expert >= num_experts:
                raise CheckFailed(f"layer {layer}: expert id {expert} >= num_experts {num_experts}")
            global_to_combined[expert] = combined
            descriptors[combined] = descriptor(tier, local)
            for p, proj in enumerate(PROJECTIONS):
                codebooks.add(linear_slice(moe, expert, proj, pieces[0].source_rank).codebook)
                _fill_trellis(reader, moe, expert, proj, pieces, hidden, source_width, slab[local, p])
                rot_intermediate[combined, p] = expected_intermediate(
                    reader, moe, expert, proj, pieces, source_width, source_shared)
                if not source_shared or combined == 0:
                    hidden_rows[p, combined] = expected_hidden(reader, moe, expert, proj, pieces, hidden,
                                                               source_shared)
                else:  # one physical row per (projection, rank) in the source: replicate it
                    hidden_rows[p, combined] = hidden_rows[p, 0]
            combined += 1
        slabs.append(slab)
    if len(codebooks) > 1:
        raise CheckFailed(f"layer {layer}: experts use several codebooks {sorted(codebooks)}; the kernel takes one")
    collapse = source_shared if shared_h is None else shared_h
    gate_suh, up_suh, down_svh = (_collapse(hidden_rows[p], tiers, layer, PROJECTIONS[p], rank) if collapse
                                  else hidden_rows[p] for p in range(3))
    return LayerPack(layer=layer, rank=rank, tp=target_tp, hidden=hidden, intermediate=width,
                     codebook=codebooks.pop() if codebooks else (checkpoint.codebook or "mcg"),
                     tier_k=[k for k, _ in tiers], tier_trellis=slabs, global_to_combined=global_to_combined,
                     descriptors=descriptors, rot_intermediate=rot_intermediate, gate_suh=gate_suh,
                     up_suh=up_suh, down_svh=down_svh)


def _fill_trellis(reader: TensorReader, moe: MoeLayer, expert: int, proj: str, pieces: list[Piece], hidden: int,
                  source_width: int, out: "torch.Tensor") -> None:
    if is_identity(pieces, source_width):
        lin = linear_slice(moe, expert, proj, pieces[0].source_rank)
        expected = (hidden // 16, source_width // 16) if proj != "down_proj" else (source_width // 16, hidden // 16)
        trellis = _trellis(lin)
        shape = tuple(trellis.shape)
        if trellis.dtype != "I16" or shape != (*expected, out.shape[-1]):
            raise CheckFailed(f"{lin.prefix}.trellis: {trellis.dtype} {list(shape)}, expected I16 "
                              f"{[*expected, out.shape[-1]]}")
        reader.read_into(trellis, out)  # the fast path: bytes land in the slab directly
        return
    out.copy_(expected_trellis(reader, moe, expert, proj, pieces, hidden, source_width))


def _collapse(rows: "torch.Tensor", tiers: list[tuple[int, list[int]]], layer: int, proj: str, rank: int) -> "torch.Tensor":
    """[E_c, H] -> [1, H] when every row is byte-equal; else refuse, naming the first differing expert."""
    import torch

    bits = rows.view(torch.int16)
    differs = (bits != bits[0:1]).any(dim=1).nonzero()
    if len(differs):
        combined = int(differs[0])
        order = [e for _, ids in tiers for e in ids]
        side = HIDDEN_SIDE[proj]
        raise CheckFailed(
            f"layer {layer} rank {rank}: {proj} {side} of expert {order[combined]} differs from expert {order[0]}; "
            f"shared-H needs every expert's hidden-side row byte-equal (refused, nothing written)"
        )
    return rows[0:1].clone()


def to_device(pack: LayerPack, device: "str | torch.device") -> LayerPack:
    """The same pack with every tensor on `device` (one copy per tensor, no layout change)."""
    def move(t: "torch.Tensor") -> "torch.Tensor":
        return t.to(device)

    return LayerPack(layer=pack.layer, rank=pack.rank, tp=pack.tp, hidden=pack.hidden,
                     intermediate=pack.intermediate, codebook=pack.codebook, tier_k=list(pack.tier_k),
                     tier_trellis=[move(t) for t in pack.tier_trellis],
                     global_to_combined=move(pack.global_to_combined), descriptors=move(pack.descriptors),
                     rot_intermediate=move(pack.rot_intermediate), gate_suh=move(pack.gate_suh),
                     up_suh=move(pack.up_suh), down_svh=move(pack.down_svh))
