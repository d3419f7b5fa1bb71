"""Every tensor of a checkpoint by name, held as its headers' own entries rather than as one dict of them.

One dict of a production checkpoint's ~935k tensors costs ~0.5 s and ~27 MB of peak to build, most of it in the cache
misses of a table that large, and the commands mostly walk the tensors in order: inspect and diff never look one
up, validate looks up a few thousand. Where the opening proved that no name is in two headers (`dialects/open.py`:
every routed-expert linear in one header, the other names distinct), the tensors are a `TensorMap`: the headers in
file order, walked as they are; a name looked up in a small dict of the names that are no linear's field, or in the
headers holding its layer's linears (each header's own dict, built on its first lookup). Its order, length and
answers are those of the dict the opening builds otherwise. The first write turns it into that dict.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, ItemsView, Iterator, KeysView, Mapping, MutableMapping, ValuesView

from trellis_cli.checkpoint.model import TensorFiles, TensorRef

_LAYERS = "model.layers."
_EXPERTS = ".mlp.experts."  # what follows the layer number in every linear's field
_MISSING: Any = object()


class TensorMap(MutableMapping[str, TensorRef]):
    """name -> TensorRef over headers whose names are proven distinct (module docstring)."""

    __slots__ = ("_parts", "_others", "_by_layer", "_length", "_whole")

    def __init__(self, parts: list[Mapping[str, TensorRef]], others: dict[str, TensorRef],
                 by_layer: dict[str, list[Mapping[str, TensorRef]]]) -> None:
        """`parts`: each header's entries, in file order; `others`: every name that is no routed-expert linear's
        field; `by_layer`: a layer number as the names spell it -> the parts holding that layer's linears."""
        self._parts = parts
        self._others = others
        self._by_layer = by_layer
        self._length = sum(map(len, parts))
        self._whole: dict[str, TensorRef] | None = None  # the dict itself, once written to

    def _find(self, name: Any) -> TensorRef:
        ref = self._others.get(name, _MISSING)
        if ref is not _MISSING or not isinstance(name, str) or not name.startswith(_LAYERS):
            return ref
        dot = name.find(".", len(_LAYERS))
        if dot < 0 or not name.startswith(_EXPERTS, dot):
            return _MISSING  # (not a linear's field: any such tensor is in `_others`)
        for part in self._by_layer.get(name[len(_LAYERS):dot], ()):
            ref = part.get(name, _MISSING)
            if ref is not _MISSING:
                return ref
        return _MISSING

    def holds(self, entries: Mapping[str, TensorRef]) -> bool:
        """Whether `entries` (a header's) are one of the parts, each of them then the model's own under its name."""
        return self._whole is None and any(part is entries for part in self._parts)

    def __getitem__(self, name: str) -> TensorRef:
        if self._whole is not None:
            return self._whole[name]
        ref = self._find(name)
        if ref is _MISSING:
            raise KeyError(name)
        return ref

    def get(self, name: str, default: Any = None) -> Any:
        if self._whole is not None:
            return self._whole.get(name, default)
        ref = self._find(name)
        return default if ref is _MISSING else ref

    def __contains__(self, name: object) -> bool:
        if self._whole is not None:
            return name in self._whole
        return self._find(name) is not _MISSING

    def __iter__(self) -> Iterator[str]:
        if self._whole is not None:
            return iter(self._whole)
        return chain.from_iterable(map(iter, self._parts))

    def __len__(self) -> int:
        return len(self._whole) if self._whole is not None else self._length

    def keys(self) -> KeysView[str]:
        return _Keys(self)

    def values(self) -> ValuesView[TensorRef]:
        return _Values(self)

    def items(self) -> ItemsView[str, TensorRef]:
        return _Items(self)

    def _written(self) -> dict[str, TensorRef]:
        """The dict itself, built once: every write goes to it (a write is rare: a name the index maps elsewhere)."""
        if self._whole is None:
            self._whole = dict(chain.from_iterable(part.items() for part in self._parts))
            self._parts, self._others, self._by_layer = [], {}, {}
        return self._whole

    def __setitem__(self, name: str, ref: TensorRef) -> None:
        self._written()[name] = ref

    def __delitem__(self, name: str) -> None:
        del self._written()[name]

    def clear(self) -> None:
        self._written().clear()

    def copy(self) -> dict[str, TensorRef]:
        """A dict of the same tensors in the same order (what `dict.copy` gives a caller who holds the dict)."""
        return dict(self.items())

    def __repr__(self) -> str:
        return f"TensorMap({len(self)} tensors)"


class _Keys(KeysView[str]):
    _mapping: TensorMap

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)


class _Values(ValuesView[TensorRef]):
    _mapping: TensorMap

    def __iter__(self) -> Iterator[TensorRef]:
        whole = self._mapping._whole
        if whole is not None:
            return iter(whole.values())
        return chain.from_iterable(part.values() for part in self._mapping._parts)


class _Items(ItemsView[str, TensorRef]):
    _mapping: TensorMap

    def __iter__(self) -> Iterator[tuple[str, TensorRef]]:
        whole = self._mapping._whole
        if whole is not None:
            return iter(whole.items())
        return chain.from_iterable(part.items() for part in self._mapping._parts)


def outside_experts(tensors: Mapping[str, TensorRef]) -> list[TensorRef]:
    """The tensors whose names hold no `.mlp.experts.`, in their order: where they are a `TensorMap`, read from the
    names held apart from the routed-expert linears' fields (whose names all hold it), not from every tensor."""
    items = tensors._others.items() if isinstance(tensors, TensorMap) and tensors._whole is None else tensors.items()
    return [ref for name, ref in items if _EXPERTS not in name]  # (the map's own order: gathered header by header)


def holds_first(tensors: Mapping[str, TensorRef], entries: Mapping[str, TensorRef]) -> bool:
    """Whether the first of a header's `entries` is in the model's `tensors` (where they are a `TensorMap`: whether
    they are its own, each one then in it, without a lookup by name)."""
    if isinstance(tensors, TensorMap) and tensors.holds(entries):
        return True
    return next(iter(entries)) in tensors


def files_named(index: Mapping[str, str]) -> set[str]:
    """The files an index names (`set(index.values())`). Where it is the tensors' own files (`TensorFiles`) over a
    `TensorMap`, each header's file that holds a tensor (its entries are placed in it), not ~935k values read."""
    tensors = index.tensors if isinstance(index, TensorFiles) else None
    if isinstance(tensors, TensorMap) and tensors._whole is None:
        return {next(iter(part.values())).file for part in tensors._parts if part}
    return set(index.values())


__all__ = ["TensorMap", "files_named", "holds_first", "outside_experts"]
