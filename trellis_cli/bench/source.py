"""What `trellis bench` runs on: a synthetic preset, a route-pack directory, or a TR3 checkpoint.

A route-pack directory (its manifest) is read layer file by layer file; a TR3 checkpoint is
built into a route pack in memory for the one (layer, rank) asked for. Without --layer the first MoE layer is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trellis_cli.bench.synthetic import Preset, get_preset, parse_partition, synthetic_pack
from trellis_cli.errors import SourceUnavailable, UsageError
from trellis_cli.formats.layer_pack import LayerPack


@dataclass
class BenchSource:
    description: str
    pack: LayerPack
    kind: Literal["synthetic", "route-pack", "checkpoint"]


def choose_source(source: str | None, synthetic: str | None,
                  partition: str | None) -> tuple[Preset, tuple[int, ...]] | None:
    """The SOURCE / --synthetic choice, checked (no GPU needed): the preset and its partition for a synthetic
    layer, None for SOURCE."""
    if synthetic and source:
        raise UsageError("give either SOURCE or --synthetic, not both")
    if synthetic:
        preset = get_preset(synthetic)
        parts = parse_partition(partition, len(preset.tier_k)) if partition else preset.partition
        if sum(parts) != preset.experts:
            raise UsageError(f"--partition {partition}: must add up to the preset's {preset.experts} experts")
        return preset, parts
    if not source:
        raise UsageError("nothing to benchmark: give SOURCE (route-pack directory or TR3 checkpoint) or "
                         "--synthetic NAME")
    if partition:
        raise UsageError("--partition applies to --synthetic only (a checkpoint declares its own)")
    return None


def load_bench_source(source: str | None, *, synthetic: str | None, partition: str | None, layer: int | None,
                      rank: int, device: str, seed: int = 0) -> BenchSource:
    chosen = choose_source(source, synthetic, partition)
    if chosen is not None:
        preset, parts = chosen
        pack = synthetic_pack(preset, parts, device=device, seed=seed)
        label = "/".join(str(p) for p in parts)
        return BenchSource(f"synthetic {preset.name} partition {label}", pack, "synthetic")
    assert source is not None  # choose_source refuses neither SOURCE nor --synthetic
    path = Path(source)
    if path.is_dir() and _is_route_pack(path):
        return _route_pack(path, layer, rank, device)
    return _checkpoint(source, layer, rank, device)


def _is_route_pack(path: Path) -> bool:
    from trellis_cli.dialects.registry import layer_pack_store

    return layer_pack_store(path) is not None


def _route_pack(path: Path, layer: int | None, rank: int, device: str) -> BenchSource:
    from trellis_cli.dialects.registry import layer_pack_store

    if layer is None:
        layer = first_route_pack_layer(path)
    store = layer_pack_store(path)
    assert store is not None  # _is_route_pack chose this path
    pack = store.read_layer_pack(path, layer, rank, device=device)
    return BenchSource(f"route-pack {path} layer {layer} rank {rank}", pack, "route-pack")


def chosen_layer(checkpoint, source: str, layer: int | None) -> int:
    """`--layer`, or the first MoE layer: a layer the checkpoint lacks is a usage error."""
    if not checkpoint.layers:
        raise SourceUnavailable(f"{source}: no MoE layers with trellis experts found")
    chosen = min(checkpoint.layers) if layer is None else layer
    if chosen not in checkpoint.layers:
        raise UsageError(f"--layer {chosen}: not a MoE layer of {source} (has {min(checkpoint.layers)}.."
                         f"{max(checkpoint.layers)})")
    return chosen


def first_route_pack_layer(path: Path) -> int:
    from trellis_cli.dialects.registry import layer_pack_store

    store = layer_pack_store(path)
    layers = store.stored_layer_packs(path) if store is not None else []
    if not layers:
        raise SourceUnavailable(f"{path}: the route pack lists no layers")
    return layers[0]


def _checkpoint(source: str, layer: int | None, rank: int, device: str) -> BenchSource:
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.dialects.registry import dialect_of
    from trellis_cli.sources import open_source

    checkpoint = open_checkpoint(open_source(source))
    chosen = chosen_layer(checkpoint, source, layer)
    dialect = dialect_of(checkpoint)
    degrees = dialect.rank_tp_degrees(checkpoint)
    pack = dialect.layer_pack(checkpoint, chosen, rank, None, device=device)  # as a repack would write it
    if degrees is not None:  # a container whose slot extents fix the slicing: one rank of them
        return BenchSource(f"{checkpoint.dialect} {source} layer {chosen} rank {rank} of tp {pack.tp}", pack,
                           "checkpoint")
    return BenchSource(f"checkpoint {source} layer {chosen} rank {rank} (route pack built in memory)", pack, "checkpoint")
