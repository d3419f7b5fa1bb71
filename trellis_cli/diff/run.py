"""`run_diff(a, b) -> DiffResult`: two checkpoints compared in the logical units of the normalized model.

Layer by layer, so memory holds one layer's units (and at most one rearranged layer-rank) at a time:
units present on one side only and dtype/shape differences come from headers; the rest are decided by
storage identity (LFS sha256, the same file) when it applies, else by a streamed sha256 of each unit's bytes
(diff/hashing.py). The TP compared is the larger of the two sides' (an exl3-v1 side is read at the other side's
TP, or at the TP its manifest's conversion note or slot layout gives when both are exl3-v1); a TR3 side at a
lower TP is re-sliced to it (exactly, or refused by name). `diff_sources(a, b)` opens both first: the one call
behind `trellis diff`.
"""

from __future__ import annotations

import dataclasses
from itertools import compress, repeat
from operator import attrgetter
from typing import AbstractSet, Any, Callable, Mapping, NamedTuple

import numpy as np

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import require_intact, same_bytes
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.diff.hashing import HEADER, SHA256, Hasher, storage_identity
from trellis_cli.diff.result import (BYTES, DTYPE, ONLY_A, ONLY_B, SHAPE, DiffResult, DiffSide, LayerDiff,
                                     TensorDifference, TierChange, UnitFacts)
from trellis_cli.diff.structure import structure_changes
from trellis_cli.diff.units import (CODES, OTHER, Key, Span, Unit, bulk_units, layer_file_tensors, layer_units,
                                    moe_layers, native_tp, other_units, read_tp)
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.sources import SourceArg

Progress = Callable[[int], None]
_FILE, _BEGIN, _END = attrgetter("file"), attrgetter("begin"), attrgetter("end")


def diff_sources(a: SourceArg, b: SourceArg, *, layers: list[int] | None = None, progress: Progress | None = None,
                 download_progress: Progress | None = None, on_layer: Callable[[int, int], None] | None = None,
                 on_open: Callable[[str], None] | None = None,
                 open_progress: Callable[[str, int, int], None] | None = None) -> DiffResult:
    """Open `a` and `b` (Sources or local paths) and compare them as `run_diff` does. `on_open(description)`
    before each side is opened, `open_progress(stage, done, total)` while its headers are read."""
    from trellis_cli.dialects.open import open_checkpoint

    checkpoints: list[Checkpoint] = []
    for side in (a, b):
        if on_open is not None:
            on_open(str(getattr(side, "description", side)))
        alike = _alike(checkpoints[0], side) if checkpoints else None
        checkpoints.append(alike if alike is not None else open_checkpoint(side, progress=open_progress))
    return run_diff(*checkpoints, layers=layers, progress=progress, download_progress=download_progress,
                    on_layer=on_layer)


def _alike(a: Checkpoint, side: Any) -> Checkpoint | None:
    """B opened as A's model over B's files, where A was opened by the shared opening (headers and JSON, no
    tensor data) and every byte it reads is the same in both (`reader.same_bytes`): the same model, without
    parsing the same headers twice. None: open B in full."""
    from trellis_cli.dialects.interface import Dialect
    from trellis_cli.dialects.open import as_source

    dialect = dialect_of(a)
    if dialect.opens_from_listing or type(dialect).fill is not Dialect.fill:
        return None  # a container read its own way: its model may keep what it read of tensor data (rate tables)
    source = as_source(side)
    files = same_bytes(a.source, a.files, source)
    if files is None:
        return None
    return dataclasses.replace(a, source=source, files=files, parse_findings=list(a.parse_findings))


def run_diff(a: Checkpoint, b: Checkpoint, *, layers: list[int] | None = None, progress: Progress | None = None,
             download_progress: Progress | None = None,
             on_layer: Callable[[int, int], None] | None = None) -> DiffResult:
    """Compare `a` and `b`. `layers` restricts the MoE layers (non-expert tensors are then not compared);
    `progress(n)` receives bytes hashed, `download_progress(n)` bytes downloaded, `on_layer(done, total)`
    each finished layer."""
    # An unreadable file would read as absent layers or tensors: refused by name instead. One model over both
    # sides' files (`_alike`) has B's listing, headers and findings the same as A's, so B's faults are A's.
    shared = a.layers is b.layers
    for side in (a,) if shared else (a, b):
        require_intact(side, "diff")
    tp = compared_tp(a, b)
    layers_a, layers_b = set(moe_layers(a)), set(moe_layers(b))
    if layers is not None:
        absent = [layer for layer in layers if layer not in layers_a | layers_b]
        if absent:
            raise UsageError(f"--layers: MoE layer(s) {', '.join(map(str, absent))} in neither checkpoint "
                             f"(A has {_span(layers_a)}, B has {_span(layers_b)})")
        chosen = set(layers)
        layers_a, layers_b = layers_a & chosen, layers_b & chosen
    both = sorted(layers_a & layers_b)
    result = DiffResult(a=_side(a), b=_side(b), compared_tp=tp, layers_compared=both,
                        structure=structure_changes(a, b), layers_only_a=sorted(layers_a - layers_b),
                        layers_only_b=sorted(layers_b - layers_a), other_tensors_compared=layers is None)
    comparer = _Comparer(a, b, result, progress, download_progress)
    for done, layer in enumerate(both, 1):
        raw_a, raw_b = layer_file_tensors(a, layer), layer_file_tensors(b, layer)
        if raw_a is not None and raw_b is not None:  # both keep the layer whole in one file
            result.layers.append(_layer_file_pair(comparer, layer, tp, raw_a, raw_b))
        elif shared and (decided := _decided_by_files(comparer, layer, tp)) is not None:
            result.layers.append(decided)
        else:
            units_a = layer_units(a, layer, tp)
            # one model over two sides' files (`_alike`): the units where the bytes lie are the same on both
            units_b = units_a if shared and _in_place(units_a) else layer_units(b, layer, tp)
            tally = comparer.compare(units_a, units_b, layer)
            facts_a = _unit_facts(units_a)
            facts_b = facts_a if units_b is units_a else _unit_facts(units_b)
            result.layers.append(_layer_diff(a, b, layer, facts_a, facts_b, tally))
        if on_layer is not None:
            on_layer(done, len(both))
    if layers is None:
        others_a = other_units(a)
        comparer.compare(others_a, others_a if shared and _in_place(others_a) else other_units(b), None)
    return result


def _layer_file_pair(comparer: "_Comparer", layer: int, tp: int, raw_a: dict[Key, Unit],
                     raw_b: dict[Key, Unit]) -> LayerDiff:
    """Two layer files (two exl3-v1 sides): the same bytes decide by storage with nothing read (a Hub pair: no
    download); otherwise expert by expert at `tp`, or tensor by tensor where a side has no TR3 form."""
    a, b = comparer.a, comparer.b
    facts_a, facts_b = _rates_facts(a, layer), _rates_facts(b, layer)
    if raw_a and raw_a.keys() == raw_b.keys() and all(comparer.same_storage(raw_a[k], raw_b[k]) for k in raw_a):
        return _layer_diff(a, b, layer, facts_a, facts_b, comparer.compare(raw_a, raw_b, layer))
    try:
        units_a, units_b = layer_units(a, layer, tp), layer_units(b, layer, tp)
    except CheckFailed:  # refused as TR3 ranks: compare the stored tensors instead
        return _layer_diff(a, b, layer, facts_a, facts_b, comparer.compare(raw_a, raw_b, layer))
    tally = comparer.compare(units_a, units_b, layer)
    return _layer_diff(a, b, layer, _unit_facts(units_a), _unit_facts(units_b), tally)


def _decided_by_files(comparer: "_Comparer", layer: int, tp: int) -> LayerDiff | None:
    """One model over both sides' files (`_alike`): the layer decided file by file from its units in bulk, without a
    record per unit, where every unit is identical (by its file's storage, in holes on both sides, or by sha256);
    None, with nothing recorded: some unit is not, and the layer goes unit by unit to name it.

    The same answer as `compare` over `layer_units`: with one model, those units are `_in_place` (the bulk comes
    only for a layer read where it lies), so `compare` decides them by `_by_storage` (a file's units all alike, by
    the file's storage identity) and `_in_holes` (each by whether its span lies in holes on both sides), and hashes
    the rest; here the same spans are asked the same questions, and a layer where any answer is not "identical"
    goes that way. The summary's facts are the same sums over the same units (`BulkUnits`)."""
    bulk = bulk_units(comparer.a, layer, tp)
    if bulk is None:
        return None
    tally = comparer.decide_files(bulk.spans)
    if tally is None:
        return None
    facts = _layer_facts(bulk.expert_ks, bulk.bits, bulk.weights, bulk.rank_bytes)
    return _layer_diff(comparer.a, comparer.b, layer, facts, facts, tally)


def _in_place(units: dict[Key, Unit]) -> bool:
    """Every unit read where it lies (none rearranged in memory from one side's bytes)."""
    return all(unit.span is not None and unit.digest is None for unit in units.values())


def _stored(unit: Unit) -> Span:
    """Where the bytes of a unit with no digest yet lie: only a unit rearranged in memory has no span, and it
    carries its digest."""
    assert unit.span is not None, "a unit without a span carries its digest"
    return unit.span


def compared_tp(a: Checkpoint, b: Checkpoint) -> int:
    ta, tb = native_tp(a), native_tp(b)
    if ta is not None and tb is not None:
        return max(ta, tb)
    if ta is not None or tb is not None:
        return ta or tb or 1
    return read_tp(a)


class _Comparer:
    def __init__(self, a: Checkpoint, b: Checkpoint, result: DiffResult, progress: Progress | None,
                 download_progress: Progress | None) -> None:
        self.a, self.b, self.result = a, b, result
        self.hash_a = Hasher(a.source, progress, download_progress)
        self.hash_b = Hasher(b.source, progress, download_progress)
        self.ids_a: dict[str, tuple | None] = {}
        self.ids_b: dict[str, tuple | None] = {}
        self.methods: dict[str, int] = {}  # of the comparison under way

    def compare(self, units_a: dict[Key, Unit], units_b: dict[Key, Unit],
                layer: int | None) -> tuple[dict[str, int], dict[str, int]]:
        """Every unit of both sides decided; (units per status, units per method) of this comparison."""
        counts = dict.fromkeys(("identical", ONLY_A, ONLY_B, DTYPE, SHAPE, BYTES), 0)
        self.methods = {}
        pending: list[Key] = []
        first_difference = len(self.result.differences)
        keys: Any = units_a.keys() | units_b.keys()
        if units_a is units_b:  # one model's units on both sides: only their bytes can differ
            pending, keys = self._in_holes(self._by_storage(units_a, counts), units_a, counts), ()
        for key in keys:  # in any order: only the differences are sorted, below
            ua, ub = units_a.get(key), units_b.get(key)
            if ua is None or ub is None:
                self._differ(counts, ONLY_A if ub is None else ONLY_B, HEADER, key, layer, ua, ub)
            elif ua.dtype != ub.dtype:
                self._differ(counts, DTYPE, HEADER, key, layer, ua, ub)
            elif ua.shape != ub.shape or ua.nbytes != ub.nbytes:
                self._differ(counts, SHAPE, HEADER, key, layer, ua, ub)
            else:
                method = self.same_storage(ua, ub)
                if method is not None:
                    self._identical(counts, method)
                else:
                    pending.append(key)
        if pending:
            digests_a = self.hash_a.digests(_stored(units_a[k]) for k in pending if units_a[k].digest is None)
            digests_b = self.hash_b.digests(_stored(units_b[k]) for k in pending if units_b[k].digest is None)
            for key in pending:
                ua, ub = units_a[key], units_b[key]
                da, db = ua.digest or digests_a[_stored(ua)], ub.digest or digests_b[_stored(ub)]
                if da == db:
                    self._identical(counts, SHA256)
                else:
                    self._differ(counts, BYTES, SHA256, key, layer, ua, ub, da, db)
        self.result.differences[first_difference:] = sorted(self.result.differences[first_difference:], key=_order)
        return self._record(counts)

    def decide_files(self, spans: dict[str, tuple[np.ndarray, np.ndarray]]
                     ) -> tuple[dict[str, int], dict[str, int]] | None:
        """One model's units on both sides, given as their spans per file (begins, ends), decided as `compare`
        decides them when every one is identical: by its file's storage identity, else in holes on both sides,
        else by sha256 of each side's bytes. (units per status, units per method), recorded; None, with nothing
        recorded, where a unit differs or cannot be read (what is hashed then is not read again: `Hasher`)."""
        by_storage = {file: self._same_files(file, file) for file in spans}
        in_holes: list[int] = []  # the bytes of each file's units in holes on both sides
        to_hash: list[Span] = []
        for file, (begins, ends) in spans.items():
            if by_storage[file] is None:
                holes_a, holes_b = self.hash_a.holes(file, begins, ends), self.hash_b.holes(file, begins, ends)
                if holes_a is None or holes_b is None:  # past the end of the file: refused by name unit by unit
                    return None
                both = holes_a & holes_b
                in_holes.append(int((ends - begins)[both].sum()))
                to_hash += map(Span, repeat(file), begins[~both].tolist(), ends[~both].tolist())
        if to_hash:
            digests_a, digests_b = self.hash_a.digests(to_hash), self.hash_b.digests(to_hash)
            if any(digests_a[span] != digests_b[span] for span in to_hash):
                return None
        self.methods = {}
        for file, method in by_storage.items():
            if method is not None:
                self.methods[method] = self.methods.get(method, 0) + len(spans[file][0])
        hashed = sum(len(spans[file][0]) for file, method in by_storage.items() if method is None)
        if hashed:
            self.methods[SHA256] = hashed
        for nbytes in in_holes:
            self.hash_a.advance(nbytes)
            self.hash_b.advance(nbytes)
        counts = dict.fromkeys(("identical", ONLY_A, ONLY_B, DTYPE, SHAPE, BYTES), 0)
        counts["identical"] = sum(len(begins) for begins, _ in spans.values())
        return self._record(counts)

    def _record(self, counts: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """Add one comparison's counts and methods to the result's; (counts, methods) of it."""
        for status, n in counts.items():
            self.result.counts[status] += n
        for method, n in self.methods.items():
            self.result.methods[method] = self.result.methods.get(method, 0) + n
        return counts, self.methods

    def _by_storage(self, units: dict[Key, Unit], counts: dict[str, int]) -> dict[str, list[Key]]:
        """The same units on both sides (one model): those in files the sources say hold the same bytes are
        identical (`same_storage`, asked once per file); the others by file, still to be decided."""
        files = set(map(_FILE, map(_stored, units.values())))
        if len(files) == 1:  # a layer in one shard: no grouping per unit
            by_file = {files.pop(): list(units)}
        else:
            by_file = {}
            for key, unit in units.items():
                by_file.setdefault(_stored(unit).file, []).append(key)
        undecided: dict[str, list[Key]] = {}
        for file, keys in by_file.items():
            method = self.same_storage(units[keys[0]], units[keys[0]])
            if method is None:
                undecided[file] = keys
                continue
            counts["identical"] += len(keys)
            self.methods[method] = self.methods.get(method, 0) + len(keys)
        return undecided

    def _in_holes(self, by_file: dict[str, list[Key]], units: dict[Key, Unit], counts: dict[str, int]) -> list[Key]:
        """Units in holes on both sides hash alike (zeros of one length): identical by sha256 without reading or
        hashing them, as `Hasher` decides them one by one. The others, to hash."""
        pending: list[Key] = []
        for file, keys in by_file.items():
            spans = list(map(_stored, map(units.__getitem__, keys)))
            begins = np.fromiter(map(_BEGIN, spans), dtype=np.int64, count=len(spans))
            ends = np.fromiter(map(_END, spans), dtype=np.int64, count=len(spans))
            holes_a, holes_b = self.hash_a.holes(file, begins, ends), self.hash_b.holes(file, begins, ends)
            if holes_a is None or holes_b is None:  # past the end of the file: `digests` refuses it by name
                pending += keys
                continue
            both = holes_a & holes_b
            alike = int(both.sum())
            if alike:
                counts["identical"] += alike
                self.methods[SHA256] = self.methods.get(SHA256, 0) + alike
                nbytes = int((ends - begins)[both].sum())
                self.hash_a.advance(nbytes)
                self.hash_b.advance(nbytes)
            pending += compress(keys, (~both).tolist())
        return pending

    def same_storage(self, ua: Unit, ub: Unit) -> str | None:
        if ua.span is None or ub.span is None or (ua.span.begin, ua.span.end) != (ub.span.begin, ub.span.end):
            return None
        return self._same_files(ua.span.file, ub.span.file)

    def _same_files(self, file_a: str, file_b: str) -> str | None:
        """The method by which A's `file_a` and B's `file_b` are the same bytes without reading them, or None."""
        ia = storage_identity(self.a.source, file_a, self.ids_a)
        ib = storage_identity(self.b.source, file_b, self.ids_b)
        return ia[0] if ia is not None and ia == ib else None

    def _identical(self, counts: dict[str, int], method: str) -> None:
        counts["identical"] += 1
        self.methods[method] = self.methods.get(method, 0) + 1

    def _differ(self, counts: dict[str, int], status: str, method: str, key: Key, layer: int | None,
                ua: Unit | None, ub: Unit | None, da: str | None = None, db: str | None = None) -> None:
        counts[status] += 1
        self.methods[method] = self.methods.get(method, 0) + 1
        expert, proj, rank, part = key
        where: dict[str, Any] = ({"tensor": proj, "layer": layer} if part == OTHER else
                                 {"layer": layer, "expert": expert, "projection": proj, "rank": rank})
        self.result.differences.append(TensorDifference(status=status, method=method, part=part,
                                                        a=_facts(ua, da), b=_facts(ub, db), **where))


def _order(d: TensorDifference) -> tuple:
    """Expert, projection, rank, part; non-expert tensors by name."""
    return (-1 if d.expert is None else d.expert, d.projection or d.tensor or "", -1 if d.rank is None else d.rank,
            d.part)


def _facts(unit: Unit | None, digest: str | None) -> UnitFacts | None:
    if unit is None:
        return None
    facts: UnitFacts = {"dtype": unit.dtype, "shape": list(unit.shape), "bytes": unit.nbytes}
    sha256 = digest or unit.digest
    if sha256:
        facts["sha256"] = sha256
    return facts


class _Facts(NamedTuple):
    """What a layer summary needs from one side: K per expert, bpw of the codes, bytes per rank."""

    expert_k: dict[int, int | None]
    bpw: float | None
    bytes_per_rank: list[int]


def _unit_facts(units: dict[Key, Unit]) -> _Facts:
    """A layer's K per expert from its codes' shapes (None where its projections or ranks disagree), bpw of its
    codes and bytes per rank, in one pass over its units (~9k per layer)."""
    seen: dict[int, set[int | None]] = {}
    per_rank: dict[int, int] = {}
    bits = weights = 0
    for (expert, _, rank, part), unit in units.items():
        if part == OTHER:
            continue
        nbytes = unit.nbytes
        per_rank[rank] = per_rank.get(rank, 0) + nbytes
        if part == CODES:
            shape = unit.shape
            three = len(shape) == 3
            seen.setdefault(expert, set()).add(shape[2] // 16 if three and shape[2] % 16 == 0 else None)
            if three:
                bits += nbytes * 8
                weights += shape[0] * shape[1] * 256
    return _layer_facts(seen, bits, weights, per_rank)


def _layer_facts(expert_ks: Mapping[int, AbstractSet[int | None]], bits: int, weights: int,
                 rank_bytes: dict[int, int]) -> _Facts:
    """The facts of a layer whose experts' codes give `expert_ks`, whose 3-D codes hold `bits` over `weights`
    weights, and whose units hold `rank_bytes` per rank."""
    return _Facts({e: (next(iter(ks)) if len(ks) == 1 else None) for e, ks in expert_ks.items()},
                  round(bits / weights, 4) if weights else None, [rank_bytes[r] for r in sorted(rank_bytes)])


def _rates_facts(ck: Checkpoint, layer: int) -> _Facts:
    """A layer compared file to file: K per expert from the side's own metadata (an exl3-v1's rate tables, when
    readable here); bpw the experts' mean K (every expert has the same number of weights); no ranks."""
    ks = dialect_of(ck).stored_expert_k(ck, layer)
    if ks is None:
        return _Facts({}, None, [])
    known = [k for k in ks.values() if k is not None]
    return _Facts(ks, round(sum(known) / len(known), 4) if len(known) == len(ks) and known else None, [])


def _layer_diff(a: Checkpoint, b: Checkpoint, layer: int, fa: _Facts, fb: _Facts,
                tally: tuple[dict[str, int], dict[str, int]]) -> LayerDiff:
    ka, kb = fa.expert_k, fb.expert_k
    changes = [TierChange(e, ka.get(e), kb.get(e)) for e in sorted(ka.keys() | kb.keys()) if ka.get(e) != kb.get(e)]
    da, db = _declared(a, layer), _declared(b, layer)
    declared = []
    if da is not None and db is not None:
        declared = [TierChange(e, da.get(e), db.get(e)) for e in sorted(da.keys() | db.keys()) if da.get(e) != db.get(e)]
    return LayerDiff(layer=layer, partition_a=_partition(ka), partition_b=_partition(kb), bpw_a=fa.bpw, bpw_b=fb.bpw,
                     bytes_per_rank_a=fa.bytes_per_rank, bytes_per_rank_b=fb.bytes_per_rank, tier_changes=changes,
                     declared_changes=declared, counts=tally[0], methods=tally[1])


def _partition(ks: dict[int, int | None]) -> dict[int, int]:
    out: dict[int, int] = {}
    for k in ks.values():
        if k is not None:
            out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items()))


def _declared(ck: Checkpoint, layer: int) -> dict[int, int] | None:
    moe = ck.layers.get(layer)
    if moe is None or moe.declared_k is None:
        return None
    return dict(enumerate(moe.declared_k))


def _side(ck: Checkpoint) -> DiffSide:
    return DiffSide(description=ck.source.description, source=dict(ck.source.describe()), dialect=ck.dialect,
                    tp=ck.tp if native_tp(ck) is not None else None, codebook=ck.codebook,
                    rotation_layout=ck.rotation_layout)


def _span(layers: set[int]) -> str:
    from trellis_cli.id_ranges import compact_ranges

    return compact_ranges(sorted(layers)) or "none"
