"""Byte arithmetic of an exl3-v1 layer: planes, bundles and rows of `codes`, rates, and TP extents.

A `codes` row is one 32-channel slot: per expert (id order) a bundle gate | up | down; each matrix section
is its low plane then its high plane; a plane is [H/16] tiles of 16*bits int16 words. Uniform rates put the
slot's two consecutive 16-channel tiles in the planes. Pair rates (8 slots = 256 channels) are record-major:
slot 8P+j holds tile j of the pair's first 128-channel record (low) and tile j of its second (high).
"""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.dialects.exl3v1.schema import (HADAMARD_BLOCK_SLOTS, KIND_OF_CODE, SLOT_CHANNELS, SLOTS_PER_PAIR, Manifest,
                                       rate_bits)

MATRICES = ("gate_proj", "up_proj", "down_proj")  # matrix m of a bundle; fc1 = gate, up; fc2 = down


def plane_bytes(hidden: int, bits: int) -> int:
    """One plane: H/16 tiles of 16*bits int16 words."""
    return hidden * 2 * bits


def section_bytes(hidden: int, code: int) -> int:
    low, high = rate_bits(code)
    return plane_bytes(hidden, low) + plane_bytes(hidden, high)


def bundle_bytes(hidden: int, fc1: int, fc2: int) -> int:
    return 2 * section_bytes(hidden, fc1) + section_bytes(hidden, fc2)


@dataclass(frozen=True)
class LayerRates:
    """Rate bytes of one layer: `fc1[p][e]`, `fc2[p][e]` per 8-slot pair p, or one code for every slot."""

    uniform: int | None
    fc1: tuple[tuple[int, ...], ...] = ()
    fc2: tuple[tuple[int, ...], ...] = ()

    def codes(self, slot: int, expert: int) -> tuple[int, int]:
        if self.uniform is not None:
            return self.uniform, self.uniform
        pair = slot // SLOTS_PER_PAIR
        return self.fc1[pair][expert], self.fc2[pair][expert]

    def used_kinds(self) -> set[str]:
        if self.uniform is not None:
            return set()
        return {KIND_OF_CODE.get(c, f"0x{c:02x}") for table in (self.fc1, self.fc2) for row in table for c in row}

    def expert_bpw(self, expert: int, num_slots: int) -> float:
        """Mean bits per weight of one expert over its three matrices and all slots."""
        total = 0
        for slot in range(0, num_slots, SLOTS_PER_PAIR if self.uniform is None else num_slots):
            fc1, fc2 = self.codes(slot, expert)
            total += 2 * sum(rate_bits(fc1)) + sum(rate_bits(fc2))
        groups = num_slots // SLOTS_PER_PAIR if self.uniform is None else 1
        return total / (6 * groups)

    def expert_k(self, expert: int, num_slots: int) -> int | None:
        """The one K of an expert when every record of all three matrices uses it (a TR3-expressible expert)."""
        widths: set[int] = set()
        for slot in range(0, num_slots, SLOTS_PER_PAIR if self.uniform is None else num_slots):
            for code in self.codes(slot, expert):
                widths.update(rate_bits(code))
        return widths.pop() if len(widths) == 1 else None


def uniform_rates(bits: int) -> LayerRates:
    return LayerRates(uniform=(bits << 4) | bits)


def row_payload(m: Manifest, rates: LayerRates, slot: int) -> int:
    """Bytes of the bundles of every expert in one row (the row stride may add zero padding)."""
    return sum(bundle_bytes(m.hidden, *rates.codes(slot, e)) for e in range(m.num_experts))


def row_payloads(m: Manifest, rates: LayerRates) -> list[int]:
    """`row_payload` of every slot, summed once per 8-slot pair (its slots share their rates) or once in all."""
    group = m.num_slots if rates.uniform is not None else SLOTS_PER_PAIR
    out: list[int] = []
    for first in range(0, m.num_slots, group):
        out += [row_payload(m, rates, first)] * min(group, m.num_slots - first)
    return out


def plane_span(m: Manifest, rates: LayerRates, slot: int, expert: int, matrix: int, plane: int,
               expert_offset: int | None = None) -> tuple[int, int]:
    """(byte offset in the row, length) of one plane; `expert_offset` skips summing earlier bundles."""
    if expert_offset is None:
        expert_offset = sum(bundle_bytes(m.hidden, *rates.codes(slot, e)) for e in range(expert))
    fc1, fc2 = rates.codes(slot, expert)
    code = fc1 if matrix < 2 else fc2
    low, high = rate_bits(code)
    offset = expert_offset + min(matrix, 2) * section_bytes(m.hidden, fc1)
    if plane == 1:
        offset += plane_bytes(m.hidden, low)
    return offset, plane_bytes(m.hidden, high if plane else low)


def expert_offsets(m: Manifest, rates: LayerRates, slot: int) -> list[int]:
    out, offset = [], 0
    for e in range(m.num_experts):
        out.append(offset)
        offset += bundle_bytes(m.hidden, *rates.codes(slot, e))
    return out


def slot_tiles(m: Manifest, local_slot: int) -> tuple[int, int]:
    """The native 16-channel tile numbers (within a TP extent) of a slot's low and high plane."""
    if not m.pair_structure:
        return 2 * local_slot, 2 * local_slot + 1
    pair, j = divmod(local_slot, SLOTS_PER_PAIR)
    return 16 * pair + j, 16 * pair + 8 + j


def slot_channels(m: Manifest, local_slot: int) -> list[int]:
    """Local intermediate channel of each of the slot's 32 stored channels (the rotations order)."""
    low, high = slot_tiles(m, local_slot)
    return [16 * low + c for c in range(16)] + [16 * high + c for c in range(16)]


# ---- TP extents ----------------------------------------------------------------------------------------

def extent_problem(m: Manifest, first: int, count: int) -> str | None:
    """Why slots [first, first+count) cannot be one rank's extent, or None when they can."""
    end = first + count
    if count <= 0 or first < 0 or end > m.num_slots:
        return f"slots [{first}, {end}) are not a non-empty range inside 0..{m.num_slots}"
    if first % m.extent_alignment or count % m.extent_alignment:
        return f"slots [{first}, {end}) are not aligned to extent_alignment_slots {m.extent_alignment}"
    inside = [b for b in m.barriers if first < b < end]
    if inside:
        return f"slots [{first}, {end}) cross the extent barrier at slot {inside[0]}"
    if count % HADAMARD_BLOCK_SLOTS:
        return f"{count} slots is not a whole number of 128-channel Hadamard blocks (4 slots)"
    if m.pair_structure and (first % SLOTS_PER_PAIR or count % SLOTS_PER_PAIR):
        return f"slots [{first}, {end}) split an 8-slot rate pair"
    return None


def rank_extent(m: Manifest, tp: int, rank: int) -> tuple[int, int]:
    per = m.num_slots // tp
    return rank * per, per


def tp_problem(m: Manifest, tp: int) -> str | None:
    if tp < 1 or m.num_slots % tp:
        return f"tp {tp} does not divide the {m.num_slots} slots"
    for rank in range(tp):
        problem = extent_problem(m, *rank_extent(m, tp, rank))
        if problem:
            return f"tp {tp}, rank {rank}: {problem}"
    return None


def tp_degrees(m: Manifest) -> list[int]:
    """Every TP degree whose equal slot ranges are all legal extents."""
    return [tp for tp in range(1, m.num_slots + 1) if tp_problem(m, tp) is None]


def hidden_table_bytes(m: Manifest) -> int:
    rows = m.num_experts if m.per_expert_input_rotations else 1
    return 3 * rows * m.hidden * 2


def rank_bytes(m: Manifest, stride: int, tp: int) -> int:
    """What one rank reads at `tp`: its codes rows and rotations, its rate rows, the whole hidden-side tables."""
    count = m.num_slots // tp
    rates = 2 * (count // SLOTS_PER_PAIR) * m.num_experts if m.pair_structure else 0
    signs = m.num_experts if m.intermediate_hadamard else 0
    return count * stride + count * m.num_experts * 3 * SLOT_CHANNELS * 2 + rates + hidden_table_bytes(m) + signs
