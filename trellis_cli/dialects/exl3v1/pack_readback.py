"""Read a route-pack layer file written from exl3-v1 back, and compare it with the source's bytes.

Not the packing path run twice: the file is parsed by safetensors (not taken from our writer), its slabs are
put back into `codes` rows by the inverse placement (pack.pack_rows) and compared byte for byte with the
source's rows (the bundles; the zero padding after them is the source's own business, checked by validate),
its intermediate vectors are put back into `rotations` rows (pack.pack_rotations) and compared with the
source's, and the hidden-side tables with the source's tables in combined order. The routing tables are
rebuilt from the tiers alone. A mismatch raises CheckFailed naming the tensor, slot and expert.
"""

from __future__ import annotations

from bisect import bisect_right
from pathlib import Path
from typing import TYPE_CHECKING

from trellis_cli.errors import CheckFailed
from trellis_cli.dialects.exl3v1.container import CODES, HIDDEN_TABLES, ROTATIONS, Exl3Layer
from trellis_cli.dialects.exl3v1.layout import LayerRates, expert_offsets, rank_extent, row_payload
from trellis_cli.dialects.exl3v1.pack import pack_rotations, pack_rows, rows_ref
from trellis_cli.dialects.exl3v1.schema import SLOT_CHANNELS, Manifest
from trellis_cli.formats.layer_pack import ROT_INTERMEDIATE, LayerPack, tier_trellis_name
from trellis_cli.dialects.routepack.layer_file import read_layer_pack
from trellis_cli.dialects.routepack.readback import _expected_tables
from trellis_cli.checkpoint.bit_compare import same_bits

if TYPE_CHECKING:
    from trellis_cli.checkpoint.tensor_bytes import TensorReader


def check_written(path: Path, m: Manifest, layer: Exl3Layer, rates: LayerRates, reader: "TensorReader", rank: int,
                  tp: int, tiers: list[tuple[int, list[int]]]) -> None:
    """Raise CheckFailed unless the file at `path` holds exactly rank `rank` of `tp` of the source layer."""
    written = read_layer_pack(path, layer.index, rank)

    def fail(tensor: str, detail: str) -> CheckFailed:
        return CheckFailed(f"{path.name}: {tensor}: read back differs from the exl3-v1 source ({detail})")

    first, count = rank_extent(m, tp, rank)
    found = (written.tp, written.hidden, written.intermediate, written.codebook)
    if found != (tp, m.hidden, count * SLOT_CHANNELS, "mcg"):
        raise fail("__metadata__", f"tp, hidden, intermediate_rank, codebook {found}")
    import torch

    got = {"tier_k": torch.tensor(written.tier_k, dtype=torch.int32),
           "tier_size": torch.tensor(written.tier_size, dtype=torch.int32),
           "global_to_combined": written.global_to_combined, "descriptors": written.descriptors}
    for name, want in _expected_tables(tiers, m.num_experts).items():
        if not same_bits(got[name], want):
            raise fail(name, "routing table")
    _check_codes(written, m, layer, rates, reader, first, tiers, fail)
    _check_rotations(written, m, layer, reader, first, count, fail)
    order = [e for _, ids in tiers for e in ids]
    for name, table in zip(HIDDEN_TABLES, (written.gate_suh, written.up_suh, written.down_svh)):
        ref = layer.required(name)
        source = torch.empty(ref.shape, dtype=torch.float16)
        reader.read_into(ref, source)
        want = source[order] if m.per_expert_input_rotations else source.reshape(1, m.hidden)
        if not same_bits(table, want):
            raise fail(f"rot.{name}", "hidden-side table")


def _check_codes(written: LayerPack, m: Manifest, layer: Exl3Layer, rates: LayerRates, reader, first: int,
                 tiers, fail) -> None:
    import numpy as np
    import torch

    ref = layer.required(CODES)
    stride = ref.shape[1]
    row = torch.empty(stride, dtype=torch.uint8)
    for j, rebuilt in enumerate(pack_rows(m, rates, written, stride)):
        slot = first + j
        reader.read_into(rows_ref(ref, slot, stride), row)
        payload = row_payload(m, rates, slot)
        want, got = row.numpy()[:payload], np.frombuffer(rebuilt, dtype=np.uint8)[:payload]
        if not np.array_equal(want, got):
            at = int(np.flatnonzero(want != got)[0])
            expert = bisect_right(expert_offsets(m, rates, slot), at) - 1
            tier = next(t for t, (_, ids) in enumerate(tiers) if expert in ids)
            raise fail(tier_trellis_name(tier), f"slot {slot} expert {expert}: codes byte {at} of the row")


def _check_rotations(written: LayerPack, m: Manifest, layer: Exl3Layer, reader, first: int, count: int,
                     fail) -> None:
    import torch

    shape = (m.num_slots, m.num_experts, 3, SLOT_CHANNELS)
    rebuilt = torch.empty(shape, dtype=torch.float16)
    pack_rotations(m, written, rebuilt)
    ref = layer.required(ROTATIONS)
    want = torch.empty((count, *shape[1:]), dtype=torch.float16)
    reader.read_into(rows_ref(ref, first, ref.nbytes // m.num_slots, count), want)
    got = rebuilt[first:first + count]
    if not same_bits(got, want):
        bits_differ = (got.view(torch.int16) != want.view(torch.int16)).reshape(count, m.num_experts, -1).any(-1)
        slot, expert = (int(i) for i in bits_differ.nonzero()[0])
        raise fail(ROT_INTERMEDIATE, f"slot {first + slot} expert {expert}")
