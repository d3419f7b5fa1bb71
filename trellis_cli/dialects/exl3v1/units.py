"""An exl3-v1 container as diff's logical units: a rank's slot extent rearranged into a LayerPack (pack.py) and
each unit's digest taken from memory; a layer file's own tensors, for two exl3-v1 sides compared file to file;
and the tensors of its other safetensors files (dialects/units.py says what a unit is)."""

from __future__ import annotations

from trellis_cli.checkpoint.model import Checkpoint, TensorRef
from trellis_cli.dialects.exl3v1.container import container, container_or_none, layer_rates
from trellis_cli.dialects.units import OTHER, Key, Unit, header_tensors, named_units, pack_units, tensor_unit, where
from trellis_cli.errors import CheckFailed, UsageError


def layer_units(ck: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
    from trellis_cli.dialects.exl3v1.pack import exl3v1_pack
    from trellis_cli.checkpoint.tensor_bytes import TensorReader

    units: dict[Key, Unit] = {}
    with TensorReader(ck.source) as reader:
        for rank in range(tp):
            try:
                pack = exl3v1_pack(ck, layer, rank, tp, reader)
            except UsageError as e:  # a TP the slot layout does not allow, a codebook without a TR3 form
                raise CheckFailed(f"{where(ck)} layer {layer}: cannot be read at TP {tp}: {e}") from None
            units.update(pack_units(pack))
    return units


def layer_file_tensors(ck: Checkpoint, layer: int) -> dict[Key, Unit]:
    """A layer file's tensors by name (codes, rotations, tables): how two exl3-v1 sides compare when their
    layer files are the same bytes, or when one cannot be read as TR3 ranks (several bit widths per expert,
    the intermediate Hadamard, another codebook)."""
    box = container_or_none(ck)
    found = box.layers.get(layer) if box is not None else None
    if found is None or not found.readable:
        return {}
    return {(None, name, None, OTHER): tensor_unit(ref) for name, ref in found.tensors.items()}


def layer_files(ck: Checkpoint) -> dict[str, int]:
    """Layer file -> the MoE layer it holds."""
    box = container_or_none(ck)
    return {layer.file: index for index, layer in box.layers.items()} if box is not None else {}


def loose_tensors(ck: Checkpoint) -> list[TensorRef]:
    """Tensors of the directory's other safetensors files (a served model keeps attention etc. there)."""
    return header_tensors(ck, set(layer_files(ck)))


def other_units(ck: Checkpoint) -> dict[Key, Unit]:
    return named_units(loose_tensors(ck))


def rate_expert_k(ck: Checkpoint, layer: int) -> dict[int, int | None] | None:
    """K per expert from the layer's rate tables; None when the manifest or the tables cannot be read here."""
    m, rates = container(ck).manifest, layer_rates(ck, layer)
    if m is None or rates is None:
        return None
    return {e: rates.expert_k(e, m.num_slots) for e in range(m.num_experts)}


def read_tp(ck: Checkpoint) -> int:
    """The TP two exl3-v1 sides are read at: the conversion note's or the slot layout's; 1 without a manifest
    (validate's finding)."""
    from trellis_cli.dialects.exl3v1.pack import default_tp

    return default_tp(ck) if container(ck).manifest is not None else 1
