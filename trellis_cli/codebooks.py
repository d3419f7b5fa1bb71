"""The EXL3 codebooks as one table: name, id, multiplier and marker tensor.

A torch-free leaf module (it imports nothing from trellis_cli), so the checkpoint model, the codec, the
route-pack format, synth and the kernel plan all read the same rows. docs/exl3-format.md §3 describes the
codebooks; docs/format.md the ids a route pack and the kernel use.
"""

from __future__ import annotations

from typing import NamedTuple


class Codebook(NamedTuple):
    name: str  # as a checkpoint's config and the CLI spell it
    id: int  # the route pack's and the kernel ABI's codebook id
    multiplier: int | None  # the procedural codebook's 32-bit multiplier; None for 3inst
    marker: str | None  # suffix of the linear's marker tensor (`<prefix>.mcg`); None for 3inst (no marker)

    @property
    def marker_value(self) -> int | None:
        """The int32 a converter stores in the marker tensor: the multiplier read as signed."""
        return None if self.multiplier is None else self.multiplier - (1 << 32 if self.multiplier >= 1 << 31 else 0)


TABLE = (
    Codebook("3inst", 0, None, None),
    Codebook("mcg", 1, 0xCBAC1FED, "mcg"),
    Codebook("mul1", 2, 0x83DCD12D, "mul1"),
)
BY_NAME = {c.name: c for c in TABLE}
NAMES = tuple(c.name for c in TABLE)  # in id order
IDS = {c.name: c.id for c in TABLE}


def _marker_value(name: str) -> int:
    value = BY_NAME[name].marker_value
    assert value is not None  # a procedural codebook: it has a multiplier
    return value


MCG_MARKER = _marker_value("mcg")  # -877912083
MUL1_MARKER = _marker_value("mul1")  # -2082680531
# codebook -> (marker tensor suffix, int32 value), or None where the codebook has no marker
MARKERS: dict[str, tuple[str, int] | None] = {
    c.name: None if c.marker is None else (c.marker, _marker_value(c.name)) for c in TABLE}
