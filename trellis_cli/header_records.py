"""A safetensors header as records: the dtypes it may name, how many tensors it may list, and the records one
parsed header is (`TensorEntry` per entry, `Entries` in stored order, `Header`).

Both readers of a header build these: the strict parser (`header.py`) and the bulk reader of safetensors' own layout
(`header_layout.py`), which the strict parser asks first; so they sit below both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from operator import attrgetter
from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from typing import Any, NamedTuple

# Tensors one header may list: 21x a production layer shard, more than a 50 GB shard (the Hub's file limit)
# of a TR3 checkpoint holds. Bounds the work per file: a 96 MB header of 1.6 million zero-size tensors is
# refused after its JSON parse, before a record per entry is built (each costs several microseconds).
MAX_HEADER_TENSORS = 1 << 18

DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
# One string object per dtype name, shared by every entry (json.loads makes a new one per tensor).
DTYPE_NAMES = {name: name for name in DTYPE_BYTES}


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    """The bytes `dtype` x `shape` holds (0 for a dtype safetensors does not know)."""
    return math.prod(shape) * DTYPE_BYTES.get(dtype, 0)


class TensorEntry(NamedTuple):
    """One header entry, placed in its file: the checkpoint model's `TensorRef` is this same record, so a header's
    entries are the model's tensors without a second object per tensor (a production checkpoint has ~935k). A
    NamedTuple: the cheapest immutable record to build and hold."""

    name: str
    file: str  # relative to the checkpoint root
    dtype: str  # safetensors dtype: "I16", "F16", "I32", ...
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the data buffer
    end: int
    data_start: int  # absolute offset of the data buffer in the file (8 + header length)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def expected_nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)

    @property
    def absolute_range(self) -> tuple[int, int]:
        return self.data_start + self.begin, self.data_start + self.end


_END = attrgetter("end")
_ENTRY_NAME = attrgetter("name")


class Entries(Mapping[str, TensorEntry]):
    """A header's entries by name, in stored order: a list, with a dict by name built on the first lookup. The
    opening reads each header's entries in order only, to merge them into the model's own dict by name
    (`Checkpoint.tensors`): a dict per header beside that one cost ~30 MB at production size (~935k tensors)."""

    __slots__ = ("_entries", "_by_name", "tiled_end")

    def __init__(self, entries: list[TensorEntry], tiled_end: int | None = None) -> None:
        self._entries = entries  # (taken, not copied: its names are distinct, as a header's keys are)
        self._by_name: dict[str, TensorEntry] | None = None
        # The data end where the entries were proven, as their columns were read, to tile the data buffer from 0
        # in stored order, each of its dtype x shape (`header_of_columns`); None where not proven.
        self.tiled_end = tiled_end

    def _lookup(self) -> dict[str, TensorEntry]:
        if self._by_name is None:
            self._by_name = dict(zip(map(_ENTRY_NAME, self._entries), self._entries))
        return self._by_name

    def __getitem__(self, name: str) -> TensorEntry:
        return self._lookup()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._lookup()

    def get(self, name: str, default: Any = None) -> Any:
        return self._lookup().get(name, default)

    def __iter__(self) -> Iterator[str]:
        return map(_ENTRY_NAME, self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> ValuesView[TensorEntry]:
        return _EntryValues(self)

    def items(self) -> ItemsView[str, TensorEntry]:
        return _EntryItems(self)

    def __repr__(self) -> str:
        return f"Entries({self._entries!r})"


class _EntryValues(ValuesView[TensorEntry]):
    _mapping: Entries

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self._mapping._entries)


class _EntryItems(ItemsView[str, TensorEntry]):
    _mapping: Entries

    def __iter__(self) -> Iterator[tuple[str, TensorEntry]]:
        entries = self._mapping._entries
        return zip(map(_ENTRY_NAME, entries), entries)


@dataclass(frozen=True)
class Header:
    file: str  # path relative to the checkpoint root
    header_len: int  # N
    file_size: int | None  # None when unknown (never for local files)
    tensors: Entries
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_end(self) -> int:
        if self.tensors.tiled_end is not None:  # proven to tile the buffer in stored order: the last entry ends it
            return self.tensors.tiled_end
        return max(map(_END, self.tensors.values()), default=0)  # in C: asked of every shard, 12k tensors each
