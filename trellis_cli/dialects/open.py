"""open_checkpoint: fill the checkpoint model from JSON files and safetensors headers, never tensor data.

Fail-closed but tolerant: an unknown dialect or an unreadable config.json raises (a route pack's config.json
is left to the route-pack verifier, which holds its hash); everything else that is wrong (a shard whose header
cannot be parsed, a path leaving the directory, an unreadable bitmap) becomes a finding in
`checkpoint.parse_findings` and parsing continues, so validate can report every problem at once.
Tensors are resolved through the headers of every safetensors file (and the index when present), never by
file-name patterns.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import replace
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, cast

from trellis_cli.checkpoint import declared as decl
from trellis_cli.checkpoint import heap
from trellis_cli.checkpoint import reader
from trellis_cli.dialects import registry
from trellis_cli.dialects.bulk_layers import LayersAsRead, build_layers_in_bulk
from trellis_cli.dialects.interface import CONFIG, QUANT_CONFIG, DialectInfo, Probe
from trellis_cli.checkpoint.linear_names import NameLinears
from trellis_cli.checkpoint.tensor_map import TensorMap
from trellis_cli.checkpoint.model import (
    Checkpoint,
    LinearRef,
    MoeLayer,
    TensorFiles,
    TensorRef,
)
from trellis_cli.checkpoint.names import (
    KIND_R7_SHARED,
    KIND_SHARED_H,
    LINEAR_FIELDS,
    LINEAR_NAME,
    LINEAR_PREFIX,
    PROJECTION_ALIASES,
    noncanonical_reason,
    parse_expert_name,
)
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header_records import Entries, Header
from trellis_cli.findings import Finding, Location, error, warning
from trellis_cli.sources import Source, SourceArg

INDEX_SUFFIX = reader.INDEX_SUFFIX
_FILE_OF = attrgetter("file")
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def open_checkpoint(source: SourceArg, *, progress: Callable[[str, int, int], None] | None = None) -> Checkpoint:
    """Parse a checkpoint from a Source (or a local directory path) into the normalized model.

    `progress(stage, done, total)`: "files" per safetensors header read, then "model" per step of building it
    (a production checkpoint takes seconds for each)."""
    with paused_gc():
        ckpt = _open(as_source(source), progress or (lambda _stage, _done, _total: None))
    assert ckpt is not None  # None only without headers
    return ckpt


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building millions of acyclic records.

    Parsing a production checkpoint allocates ~5 million objects; each young-generation pass rescans
    them, which tripled the parse time. Nothing built here forms reference cycles.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            heap.retire_young()  # what was built is long-lived: no young-generation pass rescans it
            gc.enable()


def open_declared(source: SourceArg) -> Checkpoint | None:
    """The checkpoint as its listing and JSON declare it (dialect, geometry, declared K per expert), reading no
    safetensors header: what a dry run plans from. TR3 only (its TP and layout are declared); None for any
    other dialect, whose TP or layout is known from its headers."""
    return _open(as_source(source), lambda _stage, _done, _total: None, headers=False)


def _open(source: Source, progress: Callable[[str, int, int], None], headers: bool = True) -> Checkpoint | None:
    files = reader.listing(source)
    findings: list[Finding] = list(reader.listing_findings(source))
    own = registry.detect_from_listing(files, source.read_json)
    if own is not None:  # its own verifier owns its parsing, config.json included (`Dialect.opens_from_listing`)
        if not headers:
            return None
        return Checkpoint(source=source, dialect=own.dialect, config={}, hidden=None, intermediate=None,
                          num_experts=None, tp=own.tp, codebook=own.codebook, rotation_layout=own.rotation_layout,
                          declared=own.declared, parse_findings=findings, files=dict(files))
    config = _read_config(source, files)
    quant_config = reader.read_json(source, files, QUANT_CONFIG, findings, optional=True)
    if quant_config is not None and not isinstance(quant_config, dict):
        findings.append(warning("json.unreadable", Location(file=QUANT_CONFIG), "not a JSON object: ignored",
                                expected="object", found=type(quant_config).__name__))
        quant_config = None
    probe = Probe(files, config, quant_config, source.read_json)
    info = registry.detect(probe)
    ckpt = Checkpoint(source=source, dialect=info.dialect, config=config or {}, hidden=None, intermediate=None,
                      num_experts=None, tp=info.tp, codebook=info.codebook, rotation_layout=info.rotation_layout,
                      declared=info.declared, parse_findings=findings, files=dict(files),
                      quant_config=quant_config)
    dialect = registry.dialect_named(info.dialect)
    if not headers:
        if not dialect.declared_opening:  # TP or layout from headers
            return None
        _apply_declarations(ckpt, info, source, files)
        _fill_geometry(ckpt, info)
        return ckpt
    if dialect.fill(ckpt, probe, info):  # a container read its own way
        return ckpt
    linears: dict[str, NameLinears | None] = {}  # each header's names split by a scan worker, where one read it
    read = LayersAsRead()  # the layers placed and the names told apart as each header arrives
    with reader.IndexProof(source, files) as index:  # a large index proven shard by shard as the headers arrive

        def taken(name: str, header: Header, names: reader.ShardNames) -> None:
            read.add(name, header, linears)
            index.take(name, names)

        ckpt.headers.update(reader.read_headers(source, files, progress, ckpt.parse_findings, linears, taken))
        index.finish()
    steps = (lambda: _collect_tensors(ckpt, read), lambda: _read_index(ckpt, source, files, index),
             lambda: _build_layers(ckpt, linears, read),
             lambda: _apply_declarations(ckpt, info, source, files), lambda: _fill_geometry(ckpt, info))
    for done, step in enumerate(steps, 1):
        step()
        progress("model", done, len(steps))
    return ckpt


def as_source(source: SourceArg) -> Source:
    checked = require_source(source)
    if isinstance(checked, (str, Path)):
        from trellis_cli.sources import LocalSource

        return LocalSource(Path(checked))
    return checked


def require_source(source: object) -> SourceArg:
    """`source` itself when it is a Source or a local path; else the library's own UsageError (an untyped
    caller's argument, checked at the door rather than met as an AttributeError deep inside)."""
    if isinstance(source, (str, Path)):
        return source
    if not callable(getattr(source, "list_files", None)) or not callable(getattr(source, "read_header", None)):
        raise UsageError(f"a checkpoint source must be a Source (trellis_cli.open_source) or a local path, not "
                         f"{type(source).__name__}")
    return cast(Source, source)


def _read_config(source: Source, files: dict[str, int]) -> dict[str, Any] | None:
    if CONFIG in source.special:
        raise CheckFailed(f"{CONFIG}: {source.special[CONFIG]}, not a regular file")
    if CONFIG not in files:
        return None
    config = source.read_json(CONFIG)  # unreadable config.json stops parsing: nothing else can be trusted
    if not isinstance(config, dict):
        raise CheckFailed(f"{CONFIG}: a JSON {type(config).__name__}, expected an object")
    return config


def _read_index(ckpt: Checkpoint, source: Source, files: dict[str, int], index: reader.IndexProof) -> None:
    """The index, after the tensors: a large one proven in its bytes to map every tensor to the file holding it
    is that mapping itself, never decoded (`reader.index_of`, with `index`: proven as the headers were read, where
    it could be); any other is read in full and compared."""
    proven = reader.index_of(source, files, ckpt.tensors, ckpt.headers, index)
    if proven is not None:
        ckpt.index_file, ckpt.index_metadata = proven
        ckpt.index, ckpt.index_agrees = TensorFiles(ckpt.tensors), True
        return
    found = reader.read_index(source, files, ckpt.parse_findings)
    if found is not None:
        ckpt.index_file, ckpt.index, ckpt.index_metadata = found
        _rekey_index(ckpt)


def _tensor_files(tensors: Mapping[str, TensorRef]) -> dict[str, str]:
    return dict(zip(tensors.keys(), map(_FILE_OF, tensors.values())))


def _collect_tensors(ckpt: Checkpoint, read: LayersAsRead) -> None:
    """Every tensor by name; a name in several files resolves to the first file (the index's, once it is read:
    `_rekey_index`). The header's entries are the model's TensorRefs (the same records): held as the headers
    themselves where no name is proven to be in two files (`_tensor_map`), else merged file by file in C."""
    found = _tensor_map(ckpt, read)
    if found is not None:
        ckpt.tensors = found
        return
    tensors: dict[str, TensorRef] = {}
    ckpt.tensors = tensors
    for file, header in ckpt.headers.items():
        if header.file != file:  # a header parsed under another name: its entries placed in the listed file
            ckpt.headers[file] = replace(header, tensors=Entries([ref._replace(file=file)
                                                                  for ref in header.tensors.values()]))
    headers = [ckpt.headers[file] for file in sorted(ckpt.headers)]
    for header in headers:
        tensors.update(header.tensors.items())
    if len(tensors) != sum(len(header.tensors) for header in headers):  # a name in several files: the first wins
        tensors.clear()
        for header in headers:
            for name, ref in header.tensors.items():
                if name not in tensors:
                    tensors[name] = ref


def _tensor_map(ckpt: Checkpoint, read: LayersAsRead) -> TensorMap | None:
    """The tensors as their headers hold them, where every header came in sorted file order under its own name and
    no name is in two of them: each routed-expert linear's fields in one header (`LayersAsRead.named_apart`), and
    the other names, gathered in one dict, distinct. None otherwise (`_collect_tensors` merges them, as without a
    read ahead)."""
    files = sorted(ckpt.headers)
    if not read.named_apart(files):
        return None
    parts: list[Mapping[str, TensorRef]] = []
    others: dict[str, TensorRef] = {}
    by_layer: dict[str, list[Mapping[str, TensorRef]]] = {}
    apart = 0  # names that are no linear's field
    for file in files:
        entries = ckpt.headers[file].tensors
        if not entries:
            continue
        parts.append(entries)
        layers, not_fields = read.linears_of.get(file, ((), None))
        for layer in layers:
            by_layer.setdefault(str(layer), []).append(entries)
        if not_fields is None:
            others.update(entries.items())
            apart += len(entries)
        elif not_fields.size:
            values = list(entries.values())
            others.update((values[at].name, values[at]) for at in not_fields.tolist())
            apart += not_fields.size
    return TensorMap(parts, others, by_layer) if len(others) == apart else None


def _rekey_index(ckpt: Checkpoint) -> None:
    """A name in several files resolves to the index's file. The index is re-keyed on the header's own name
    strings: halves its memory at production size. An index that maps every tensor to the file it was found in
    (compared in C) is that mapping itself, read from the tensors (`TensorFiles`)."""
    tensors = ckpt.tensors
    assert ckpt.index is not None
    if _tensor_files(tensors) == ckpt.index:
        ckpt.index, ckpt.index_agrees = TensorFiles(tensors), True
        return
    compact: dict[str, str] = {}
    file_names = {file: file for file in ckpt.headers}
    for name, file in ckpt.index.items():
        ref = tensors.get(name)
        file = file_names.setdefault(file, file)
        if ref is None:
            compact[name] = file
            continue
        compact[ref.name] = file
        if ref.file != file:
            header = ckpt.headers.get(file)
            if header is not None and name in header.tensors:
                tensors[name] = header.tensors[name]
    ckpt.index = compact


def _build_layers(ckpt: Checkpoint, split: dict[str, NameLinears | None], read: LayersAsRead) -> None:
    bulk = read.finish(ckpt) or build_layers_in_bulk(ckpt, _add_other_expert_tensor, split)
    split.clear()  # (not held once the layers are built)
    if bulk:
        return  # (canonically named linears, the common case: the same records, built without a step per tensor)
    # The ~935k per-expert tensors of a production checkpoint are grouped by their name less its field (one
    # string split and one dict lookup per tensor); the grammar is matched once per linear, not per tensor.
    # A field outside the EXL3 set takes the whole-name match, so every name is read as LINEAR_NAME reads it.
    groups: dict[str, dict[str, TensorRef] | None] = {}  # name less field -> its linear's fields (None: no linear)
    linears: dict[tuple[int, int, str, int], dict[str, TensorRef]] = {}
    layers = ckpt.layers
    sliced: set[int] = set()
    match_linear, match_prefix = LINEAR_NAME.match, LINEAR_PREFIX.fullmatch
    for name, ref in ckpt.tensors.items():
        if ".mlp.experts." not in name and name.isascii():
            continue  # (a non-ASCII name may read as an expert tensor once normalized: the slow path sees it)
        prefix, _, fieldname = name.rpartition(".")
        if fieldname in LINEAR_FIELDS:
            fields = groups.get(prefix, _UNSEEN)
            if fields is _UNSEEN:
                m = match_prefix(prefix)
                fields = groups[prefix] = None if m is None else _linear_fields(linears, sliced, *m.groups())
            if fields is not None:
                fields[fieldname] = ref
                continue
        else:
            m = match_linear(name)
            if m is not None:
                layer_s, expert_s, proj, rank_s, fieldname = m.groups()
                _linear_fields(linears, sliced, layer_s, expert_s, proj, rank_s)[fieldname] = ref
                continue
        _add_other_expert_tensor(ckpt, name, ref)
    del groups  # ~233k prefixes: freed before the linears are built (the opening's peak is here)
    new, linear = tuple.__new__, LinearRef
    pop = linears.pop
    for key in list(linears):  # each linear's fields freed as its record is made
        li, expert, proj, rank = key
        fields = pop(key)
        layer = layers.get(li)
        if layer is None:
            layer = layers[li] = MoeLayer(li)
        any_ref = next(iter(fields.values()))
        layer.files.add(any_ref.file)
        get = fields.get
        extra = () if fields.keys() <= LINEAR_FIELDS else tuple(ref for f, ref in fields.items()
                                                                  if f not in LINEAR_FIELDS)
        lin = new(linear, (get("trellis"), get("suh"), get("svh"), get("su"), get("sv"), get("mcg"), get("mul1"),
                           extra))
        by_expert = layer.experts.get(expert)
        if by_expert is None:
            by_expert = layer.experts[expert] = {}
        by_proj = by_expert.get(proj)
        if by_proj is None:
            by_proj = by_expert[proj] = {}
        by_proj[rank] = lin
    for li in sliced:
        layers[li].rank_sliced = True
    ckpt.layers = dict(sorted(layers.items()))


_UNSEEN: Any = object()


def _linear_fields(linears: dict[tuple[int, int, str, int], dict[str, TensorRef]], sliced: set[int], layer_s: str,
                   expert_s: str, proj: str, rank_s: str | None) -> dict[str, TensorRef]:
    """The fields of the linear (layer, expert, projection, rank) a name's groups say: one per linear however
    its projection is spelled (`w1` is `gate_proj`) or its rank 0 written (none is rank 0)."""
    layer_i = int(layer_s)
    if rank_s is not None:
        sliced.add(layer_i)
    key = (layer_i, int(expert_s), PROJECTION_ALIASES[proj], int(rank_s or 0))
    fields = linears.get(key)
    if fields is None:
        fields = linears[key] = {}
    return fields


def _add_other_expert_tensor(ckpt: Checkpoint, name: str, ref: TensorRef) -> None:
    reason = noncanonical_reason(name)
    if reason is not None:  # not the tensor it looks like: whatever it stands for counts as missing
        ckpt.parse_findings.append(error(
            "tensor.noncanonical", Location(file=ref.file, tensor=name), f"reads as a routed-expert tensor, but "
            f"{reason}: loaders look tensors up by the schema's exact name, so they never find this one"))
        return
    parsed = parse_expert_name(name)
    if parsed is None:
        return
    layers = ckpt.layers
    layer = layers.get(parsed.layer)
    if layer is None:
        layer = layers[parsed.layer] = MoeLayer(parsed.layer)
    layer.files.add(ref.file)
    if parsed.kind == KIND_SHARED_H:
        # the shared-H grammar always yields a projection, a rank and a field
        assert parsed.projection is not None and parsed.rank is not None and parsed.field is not None
        layer.shared_h.setdefault((parsed.projection, parsed.rank), {})[parsed.field] = ref
    elif parsed.kind == KIND_R7_SHARED:
        assert parsed.field is not None  # the R7 grammar always yields a field
        layer.r7_shared[parsed.field if parsed.rank is None else f"rank{parsed.rank}.{parsed.field}"] = ref
    else:
        layer.unparsed.append(ref)


def _apply_declarations(ckpt: Checkpoint, info: DialectInfo, source: Source, files: dict[str, int]) -> None:
    """The dialect's own declarations (`Dialect.declarations`), applied to the model's layers."""
    d = registry.dialect_named(info.dialect).declarations(ckpt, info, source.read_json, files)
    if d is None:
        return
    ckpt.parse_findings.extend(d.findings)
    for li, ks in d.expert_k.items():
        ckpt.layers.setdefault(li, MoeLayer(li)).declared_k = ks
    for li, pk in d.projection_k.items():
        ckpt.layers.setdefault(li, MoeLayer(li)).declared_projection_k = pk
    ckpt.layers = dict(sorted(ckpt.layers.items()))
    ckpt.k_source = d.k_source


def _fill_geometry(ckpt: Checkpoint, info: DialectInfo) -> None:
    """H, I and E from config.json, or from the first complete expert when the config does not say.

    A count above `ckpt.count_limit` (declared, or inferred from one tensor name) is reported once as
    `count.implausible` and replaced by what the tensors present support, so no later stage iterates or
    allocates by it; ids beyond the limit stay in the model, where validate reports them as extras.
    """
    dialect = registry.dialect_named(info.dialect)
    config, hybrid = ckpt.config, dialect.rank_sliced_contract(ckpt) or {}
    limit = ckpt.count_limit
    ckpt.hidden = _int(config.get("hidden_size"))
    ckpt.intermediate = _int(config.get("moe_intermediate_size"))
    span = decl.layer_span(hybrid.get("moe_layers"))
    if span > limit:
        _implausible(ckpt, Location(file=CONFIG, tensor="hybrid_tr3_tail.moe_layers"), "MoE layers", span)
    declared = [("hybrid_tr3_tail.experts_per_layer", hybrid.get("experts_per_layer")),
                *((key, config.get(key)) for key in EXPERT_COUNT_KEYS)]
    key, ckpt.num_experts = next(((k, _int(v)) for k, v in declared if _int(v)), (None, None))
    if ckpt.num_experts is not None and ckpt.num_experts > limit:
        _implausible(ckpt, Location(file=CONFIG, tensor=key), "experts per layer", ckpt.num_experts)
        ckpt.num_experts = None  # inferred from the expert ids below
    if dialect.tp_from_rank_ids:
        ranks = _ids(ckpt, "rank")
        ckpt.tp = _plausible_max(ckpt, ranks, "ranks", limit) + 1 if ranks else 1
    elif ckpt.tp > limit:
        _implausible(ckpt, Location(file=CONFIG, tensor="hybrid_tr3_tail.tp"), "ranks", ckpt.tp)
        ranks = _ids(ckpt, "rank")
        ckpt.tp = max((r for r in ranks if r < limit), default=0) + 1
    inferred = []
    sample = _first_gate(ckpt)
    if ckpt.hidden is None and sample is not None and sample.in_features:
        ckpt.hidden = sample.in_features
        inferred.append("hidden")
    if ckpt.intermediate is None and sample is not None and sample.out_features:
        ckpt.intermediate = sample.out_features * ckpt.tp
        inferred.append("intermediate")
    if ckpt.num_experts is None:
        experts = _ids(ckpt, "expert")
        ckpt.num_experts = _plausible_max(ckpt, experts, "experts per layer", limit) + 1 if experts else None
        inferred.append("num_experts")
    ckpt.inferred = inferred


def _ids(ckpt: Checkpoint, kind: str) -> dict[int, str]:
    """Every expert id (kind "expert") or rank-slice id ("rank") present, with one linear's name holding it."""
    found: dict[int, str] = {}
    for layer in ckpt.layers.values():
        for expert, projs in layer.experts.items():
            for by_rank in projs.values():
                for rank, lin in by_rank.items():
                    if kind == "expert":
                        found.setdefault(expert, lin.prefix)
                    elif layer.rank_sliced:
                        found.setdefault(rank, lin.prefix)
    return found


def _plausible_max(ckpt: Checkpoint, ids: dict[int, str], what: str, limit: int) -> int:
    """The largest id below `limit`; the largest id at or above it is reported, naming its tensor."""
    top = max(ids)
    if top >= limit:
        _implausible(ckpt, Location(tensor=ids[top]), what, top + 1)
    return max((i for i in ids if i < limit), default=0)


def _implausible(ckpt: Checkpoint, where: Location, what: str, count: int) -> None:
    ckpt.parse_findings.append(error(
        "count.implausible", where, f"{what}: far more than these files can hold (reported once, not per "
        f"missing item)", expected=f"<= {ckpt.count_limit} ({len(ckpt.tensors)} tensors present)", found=count))


def _first_gate(ckpt: Checkpoint) -> LinearRef | None:
    for layer in ckpt.layers.values():
        for projs in layer.experts.values():
            for lin in projs.get("gate_proj", {}).values():
                if lin.in_features:
                    return lin
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
