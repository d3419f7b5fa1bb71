"""What `trellis bench --tp N` runs on: which N a source can give, one rank's slice, the whole-layer reference.

`plan_tp_source` runs once, before any rank process starts, and refuses an N the source's slicing cannot give
(UsageError, exit 2). It reads headers only, plus the hidden-side vectors of the layer when N merges source
ranks (a merge is exact only when they are byte-equal, dialects/routepack/plan.py). The plan it returns is small and
picklable; each rank process then calls `load_rank_pack` for its own slice and nothing else:

- a TR3 (or plain EXL3) checkpoint: the route-pack builder for that rank, re-slicing when N differs from the
  checkpoint's TP (dialects/shard_pack.py);
- a route pack: its layer-rank file (its TP is fixed when it is written);
- exl3-v1: that rank's slot extents;
- a synthetic preset: that rank's slice drawn at N ranks (bench/synthetic.py).

`whole_layer_reference` is the float64 forward of the unsliced layer where one exists apart from the rank
slices: a TR3 checkpoint's own stored slices (read directly, summed over its ranks) or an exl3-v1 layer at
TP 1. A synthetic layer or a route pack is its rank slices, so its reference is their sum (None here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from trellis_cli.bench.synthetic import Preset, get_preset, synthetic_pack
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.reference import Expert, layer_pack_forward, moe_forward
from trellis_cli.formats.layer_pack import LayerPack

# "sliced": a container whose slot extents fix the TP degrees (each rank is one extent, the whole layer is
# rank 0 of TP1); "checkpoint": per-linear shards re-sliced exactly.
TpKind = Literal["checkpoint", "sliced", "route-pack", "synthetic"]
KINDS: tuple[TpKind, ...] = ("checkpoint", "sliced", "route-pack", "synthetic")


@dataclass(frozen=True)
class TpPlan:
    kind: TpKind
    source: str  # path or Hub id; the preset name for "synthetic"
    layer: int
    tp: int
    partition: tuple[int, ...] = ()  # synthetic only
    description: str = ""

    @property
    def has_whole_layer(self) -> bool:
        return self.kind in ("checkpoint", "sliced")


def plan_tp_source(source: str | None, *, synthetic: str | None, partition: str | None, layer: int | None,
                   tp: int, tp_given: bool = True) -> TpPlan:
    """`tp_given=False`: the user gave no --tp (the CPU check runs one rank), which refusals say."""
    from trellis_cli.bench.source import choose_source, first_route_pack_layer

    if tp < 1:
        raise UsageError(f"--tp {tp}: must be at least 1")
    chosen = choose_source(source, synthetic, partition)
    if chosen is not None:
        return _plan_synthetic(*chosen, tp)
    from trellis_cli.dialects.registry import layer_pack_store

    assert source is not None  # choose_source answers None only for a SOURCE
    path = Path(source)
    if path.is_dir() and layer_pack_store(path) is not None:
        return _plan_route_pack(path, first_route_pack_layer(path) if layer is None else layer, tp)
    return _plan_checkpoint(source, layer, tp, tp_given)


def _plan_synthetic(preset: Preset, parts: tuple[int, ...], tp: int) -> TpPlan:
    from trellis_cli.dialects.tp_reslice import rank_pieces

    rank_pieces(preset.intermediate * preset.tp, preset.tp, tp, 0)  # the same 128-block rule as a checkpoint
    label = "/".join(str(p) for p in parts)
    return TpPlan("synthetic", preset.name, 0, tp, tuple(parts), f"synthetic {preset.name} partition {label} at TP{tp}")


def _plan_route_pack(path: Path, layer: int, tp: int) -> TpPlan:
    from trellis_cli.dialects.registry import layer_pack_store

    store = layer_pack_store(path)
    assert store is not None  # plan_tp chose this path
    pack_tp = store.layer_pack_tp(path)
    if pack_tp != tp:
        raise UsageError(f"--tp {tp}: the route pack {path} was written for TP {pack_tp} (a route pack is "
                         f"not re-sliced; repack the checkpoint with --tp {tp})")
    missing = [r for r in range(tp) if not store.layer_pack_path(path, layer, r).is_file()]
    if missing:
        raise UsageError(f"--tp {tp}: the route pack {path} has no layer {layer} file for rank(s) {missing}")
    return TpPlan("route-pack", str(path), layer, tp, description=f"route-pack {path} layer {layer} at TP{tp}")


def _open(source: str):
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.sources import open_source

    return open_checkpoint(open_source(source))


def _plan_checkpoint(source: str, layer: int | None, tp: int, tp_given: bool = True) -> TpPlan:
    from trellis_cli.bench.source import chosen_layer

    from trellis_cli.dialects.registry import dialect_of

    checkpoint = _open(source)
    chosen = chosen_layer(checkpoint, source, layer)
    allowed = dialect_of(checkpoint).rank_tp_degrees(checkpoint)
    if allowed is not None:
        if tp not in allowed:
            raise UsageError(f"--tp {tp}: this {checkpoint.dialect} checkpoint's slot extents split into TP "
                             f"{', '.join(map(str, allowed))} only")
        return TpPlan("sliced", source, chosen, tp, description=f"{checkpoint.dialect} {source} layer {chosen} at "
                      f"TP{tp}")
    _check_checkpoint_slicing(checkpoint, chosen, tp, tp_given)
    return TpPlan("checkpoint", source, chosen, tp,
                  description=f"checkpoint {source} layer {chosen} at TP{tp} (source TP{checkpoint.tp})")


def _check_checkpoint_slicing(checkpoint, layer: int, tp: int, tp_given: bool = True) -> None:
    """UsageError unless every target rank is an exact re-slice of the source's ranks."""
    from trellis_cli.dialects.shard_pack import PROJECTIONS, expected_hidden, source_is_shared_h
    from trellis_cli.dialects.tp_reslice import rank_pieces
    from trellis_cli.checkpoint.tensor_bytes import TensorReader

    if checkpoint.hidden is None or checkpoint.intermediate is None:
        raise UsageError("the source declares no hidden or intermediate size; it cannot be sliced")
    pieces = [rank_pieces(checkpoint.intermediate, checkpoint.tp, tp, r) for r in range(tp)]
    merged = [p for p in pieces if len(p) > 1]
    if not merged:
        return
    moe, shared = checkpoint.layers[layer], source_is_shared_h(checkpoint)
    with TensorReader(checkpoint.source) as reader:
        try:
            for rank_pieces_ in merged:
                for expert in sorted(moe.experts):
                    for proj in PROJECTIONS:
                        expected_hidden(reader, moe, expert, proj, rank_pieces_, checkpoint.hidden, shared)
        except CheckFailed as err:
            if not tp_given:
                raise UsageError(f"without --tp the layer runs as one rank, which merges this checkpoint's "
                                 f"{checkpoint.tp} ranks, and they cannot be merged exactly: {err}; pass --tp "
                                 f"{checkpoint.tp} (the checkpoint's own slicing)") from None
            raise UsageError(f"--tp {tp} merges source ranks, which this checkpoint cannot give: {err}") from None


def load_rank_pack(plan: TpPlan, rank: int, device: torch.device | str, seed: int = 0) -> LayerPack:
    """Rank `rank`'s slice of the planned layer on `device`, and only that slice."""
    if plan.kind == "synthetic":
        preset = get_preset(plan.source)
        at_tp = dataclasses.replace(preset, intermediate=preset.intermediate * preset.tp // plan.tp, tp=plan.tp)
        return synthetic_pack(at_tp, plan.partition, device=device, seed=seed, rank=rank)
    if plan.kind == "route-pack":
        from trellis_cli.dialects.registry import layer_pack_store

        store = layer_pack_store(Path(plan.source))
        assert store is not None  # plan_tp chose this kind
        return store.read_layer_pack(Path(plan.source), plan.layer, rank, device=str(device))
    from trellis_cli.dialects.registry import dialect_of

    checkpoint = _open(plan.source)
    return dialect_of(checkpoint).layer_pack(checkpoint, plan.layer, rank, plan.tp, device=str(device))


def whole_layer_reference(plan: TpPlan, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                          ) -> torch.Tensor | None:
    """The float64 forward of the unsliced layer on x's device; None when the layer is its rank slices."""
    if not plan.has_whole_layer:
        return None
    checkpoint = _open(plan.source)
    if plan.kind == "sliced":  # the whole layer is its one rank at TP1
        from trellis_cli.dialects.registry import dialect_of

        whole = dialect_of(checkpoint).layer_pack(checkpoint, plan.layer, 0, 1)
        return layer_pack_forward(whole, x.cpu(), ids.cpu(), weights.cpu()).to(x.device)
    return _stored_slices_forward(checkpoint, plan.layer, x, ids, weights)


def _stored_slices_forward(checkpoint, layer: int, x: torch.Tensor, ids: torch.Tensor,
                           weights: torch.Tensor) -> torch.Tensor:
    """Σ over the checkpoint's own ranks of the reference forward of its stored slices (no route pack)."""
    from trellis_cli.dialects.shard_pack import PROJECTIONS, linear_slice, source_is_shared_h, vector_ref
    from trellis_cli.checkpoint.tensor_bytes import TensorReader

    moe, shared = checkpoint.layers[layer], source_is_shared_h(checkpoint)
    routed = [e for e in torch.unique(ids).tolist() if e in moe.experts]
    total = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    with TensorReader(checkpoint.source) as reader:
        def read(ref) -> torch.Tensor:
            return reader.read(ref).to(x.device)

        for rank in range(checkpoint.tp):
            experts: dict[int, Expert] = {}
            codebook = "mcg"
            for expert in routed:
                triples = []
                for proj in PROJECTIONS:
                    lin = linear_slice(moe, expert, proj, rank)
                    codebook = lin.codebook
                    triples.append((read(lin.trellis), read(vector_ref(moe, lin, proj, rank, "suh", shared)),
                                    read(vector_ref(moe, lin, proj, rank, "svh", shared))))
                gate, up, down = triples
                experts[expert] = (gate, up, down)
            total += moe_forward(x, experts, ids, weights, codebook)
    return total
