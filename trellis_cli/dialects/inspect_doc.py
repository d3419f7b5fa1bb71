"""The inspect document of a checkpoint stored as per-linear safetensors shards (the `Dialect` default), and the
parts every dialect's inspect document shares: a layer's summary row, runs of identical layers collapsed for
reading, whole-checkpoint totals and the source's description.

Built from the checkpoint model only (headers and JSON), so it works header-only on a remote checkpoint.
Plain data out; inspect_report renders it.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain
from operator import attrgetter
from typing import Any, Collection, Mapping, Sequence, TypedDict

from trellis_cli.checkpoint import layer_columns
from trellis_cli.checkpoint.model import Checkpoint, MoeLayer, TensorRef
from trellis_cli.id_ranges import compact_ranges


class Geometry(TypedDict):
    """A document's `geometry`: what the model says of the checkpoint's shape."""

    hidden: int | None
    intermediate: int | None
    intermediate_per_rank: int | None
    experts: int | None
    tp: int
    codebook: str | None
    rotation_layout: str


class LayerRow(TypedDict):
    """One MoE layer of per-linear shards (`layers` of the document), in its JSON key order."""

    layer: int
    partition: str  # experts per tier, "192/64"; "-" without one
    k_values: list[int]
    experts: int
    bpw: float
    tiers: dict[str, str]  # "K<k>" -> its experts as id ranges
    projection_k: dict[str, int] | None  # (expert, projection) pairs per K where K varies within an expert
    declared_projection_k: dict[str, int] | None  # the same, as R7 / tensor_storage maps declare it
    bytes_per_rank: int
    trellis_bytes_per_rank: int
    ranks: int
    rotation: str
    shards: list[str]
    tensors: int


class Totals(TypedDict):
    """The whole checkpoint's `totals`, whatever --layers shows (a dialect's document may add to them)."""

    layers: int
    routed_bytes_per_rank: int
    mtp_routed_bytes_per_rank: int
    routed_trellis_bytes_per_rank: int
    checkpoint_bytes: int
    tensor_bytes: int
    non_routed_bytes: int
    weights_per_rank_bytes: int  # an estimate: non-routed tensors split evenly over the TP ranks
    tensors: int
    files: int


class _RunFields(TypedDict):

    layers: list[int]
    shards: list[str]
    partition: str
    k_values: list[Any]  # K per tier; exl3-v1 adds "mixed" (several K in one expert)
    bpw: float | None
    bytes_per_rank: int
    trellis_bytes_per_rank: int
    rotation: str
    tensors: int
    projection_k: dict[str, int] | None
    declared_projection_k: dict[str, int] | None
    tiers: dict[str, str] | None  # None: tier membership varies across the run
    layer_range: str


class RunRow(_RunFields, total=False):
    """Consecutive layers that read alike, collapsed (`runs` of the document), in its JSON key order."""

    rank_bytes: dict[str, int]  # exl3-v1: bytes one rank reads at each TP its slots allow


class Selection(TypedDict):
    """`--layers`: what the chosen layers alone hold (totals stay the whole checkpoint's)."""

    layers: str
    routed_bytes_per_rank: int
    routed_trellis_bytes_per_rank: int


class InspectSummary(TypedDict):
    """What every dialect's inspect document starts with; each dialect's document extends it (`ShardDocument`
    here, `Exl3v1Document` and `RoutePackDocument` in their dialects' inspect.py)."""

    dialect: str
    source: dict[str, Any]  # Source.describe(), its revision filled in


class _ShardFields(InspectSummary):

    geometry: Geometry
    declared: dict[str, Any]  # config.json's rank-sliced contract keys, where it has one
    layers: list[LayerRow]
    runs: list[RunRow]
    totals: Totals
    parse_findings: list[dict[str, Any]]


class ShardDocument(_ShardFields, total=False):
    """The per-linear shard inspect document (the `Dialect` default)."""

    selection: Selection  # with --layers only


def geometry(ckpt: Checkpoint) -> Geometry:
    return {"hidden": ckpt.hidden, "intermediate": ckpt.intermediate,
            "intermediate_per_rank": ckpt.intermediate_per_rank, "experts": ckpt.num_experts, "tp": ckpt.tp,
            "codebook": ckpt.codebook, "rotation_layout": ckpt.rotation_layout}


def shard_document(ckpt: Checkpoint, layers: list[int] | None = None) -> ShardDocument:
    """The inspect document of per-linear shards: a summary row per chosen MoE layer, runs, totals."""
    from trellis_cli.selection import require_present

    chosen = list(ckpt.layers) if layers is None else require_present(layers, ckpt.layers)
    rows = [layer_summary(ckpt, ckpt.layers[li]) for li in chosen]
    # Totals describe the whole checkpoint, whatever --layers shows; the selection gets its own.
    every = rows if layers is None else [layer_summary(ckpt, moe) for moe in ckpt.layers.values()]
    document: ShardDocument = {
        "dialect": ckpt.dialect,
        "source": describe_source(ckpt),
        "geometry": geometry(ckpt),
        "declared": _declared_keys(ckpt),
        "layers": rows,
        "runs": collapse_runs(rows),
        "totals": totals(ckpt, every),
        "parse_findings": [f.to_dict() for f in ckpt.parse_findings],
    }
    if layers is not None:
        document["selection"] = {"layers": compact_ranges(chosen),
                                 "routed_bytes_per_rank": sum(r["bytes_per_rank"] for r in rows),
                                 "routed_trellis_bytes_per_rank": sum(r["trellis_bytes_per_rank"] for r in rows)}
    return document


def describe_source(ckpt: Checkpoint) -> dict[str, Any]:
    info = dict(ckpt.source.describe())  # a copy: the source's own answer stays as it was
    info.setdefault("revision", ckpt.source.revision)  # a library's own Source may leave it out
    return info


def _declared_keys(ckpt: Checkpoint) -> dict[str, Any]:
    # config.json's rank-sliced contract, where it has one (detection takes any config with one for TR3, so a
    # shard dialect that has none shows none)
    hybrid = ckpt.config.get("hybrid_tr3_tail")
    hybrid = hybrid if isinstance(hybrid, dict) else {}
    keys = ("format", "bits", "k_values", "bits_per_expert", "codebook", "experts_per_layer", "moe_layers", "tp",
            "rotation_layout")
    out = {k: hybrid[k] for k in keys if k in hybrid}
    q = ckpt.config.get("quantization_config")
    if isinstance(q, dict):
        out["quant_method"] = q.get("quant_method")
        if q.get("scope") is not None:  # a scope (GLM-5.3's unsliced stream) declares its one K there
            out["scope"] = q["scope"]
            out.setdefault("bits", q.get("bits"))
    sources = sorted(set(ckpt.k_source.values()))
    if sources:
        out["k_source"] = sources
    return out


def layer_summary(ckpt: Checkpoint, layer: MoeLayer, bulk: bool = True) -> LayerRow:
    """One layer's row. `bulk`: its linears' counts from the layer's columns where they are regular
    (`_column_counts`); False walks them one by one (the tests compare the two)."""
    cols = layer_columns.columns(layer)
    tiers = cols.partition()
    n_experts = sum(len(ids) for ids in tiers.values())
    counts = _column_counts(cols) if bulk else None
    rank_bytes, trellis_bytes, tensors, proj_k = counts if counts is not None else _walked_counts(layer)
    for (_, rank), fields in layer.shared_h.items():
        for ref in fields.values():
            rank_bytes[rank] += ref.nbytes
            tensors += 1
    bpw = sum(k * n for k, n in proj_k.items()) / max(sum(proj_k.values()), 1)
    per_projection = len({k for k in proj_k}) > len(tiers) or not cols.every_expert_one_k()
    return {
        "layer": layer.index,
        "partition": "/".join(str(len(ids)) for ids in tiers.values()) if tiers else "-",
        "k_values": list(tiers),
        "experts": n_experts,
        "bpw": round(bpw, 3),
        "tiers": {f"K{k}": compact_ranges(ids) for k, ids in tiers.items()},
        "projection_k": {f"K{k}": n for k, n in sorted(proj_k.items())} if per_projection else None,
        "declared_projection_k": _declared_projection_counts(layer),
        "bytes_per_rank": max(rank_bytes.values(), default=0),
        "trellis_bytes_per_rank": max(trellis_bytes.values(), default=0),
        "ranks": len(rank_bytes),
        "rotation": "shared_h_v1" if layer.shared_h else ("r7_shared" if layer.r7_shared else "per_expert_v1"),
        "shards": sorted(layer.files),
        "tensors": tensors + len(layer.r7_shared) + len(layer.unparsed),
    }


_Counts = tuple[Counter[int], Counter[int], int, Counter[int]]  # bytes per rank, trellis bytes per rank, tensors, K


def _walked_counts(layer: MoeLayer) -> _Counts:
    """Per rank the bytes of every field and of the trellis, the tensors, and how many (expert, projection)
    pairs hold each K (their ranks agreeing), walking every linear."""
    rank_bytes: Counter[int] = Counter()
    trellis_bytes: Counter[int] = Counter()
    tensors = 0
    proj_k: Counter[int] = Counter()
    for projs in layer.experts.values():
        for by_rank in projs.values():
            ks = {lin.k for lin in by_rank.values()}
            k = ks.pop() if len(ks) == 1 else None
            if k is not None:
                proj_k[k] += 1
            for rank, lin in by_rank.items():  # ~233k linears at production size: no call per tensor
                refs = [ref for ref in lin[:7] if ref is not None]  # trellis, suh, svh, su, sv, mcg, mul1
                refs += lin.extra
                if refs:
                    rank_bytes[rank] += sum([ref.end - ref.begin for ref in refs])
                    tensors += len(refs)
                if lin.trellis is not None:
                    trellis_bytes[rank] += lin.trellis.end - lin.trellis.begin
    return rank_bytes, trellis_bytes, tensors, proj_k


def _column_counts(cols: layer_columns.LayerColumns) -> _Counts | None:
    """`_walked_counts` from the columns, in C: where every expert holds the same projections and ranks in the same
    order (a rank's linears are then every len(ranks)-th of a column), each linear has a trellis and none an extra
    field. None otherwise."""
    layout = cols.layout()
    n = len(cols.linears)
    if layout is None or cols.present(layer_columns.TRELLIS) != n or any(cols.field(layer_columns.EXTRA)):
        return None
    projs, ranks = layout
    per_field = [cols.rank_bytes(i) for i in layer_columns.TENSOR_FIELDS]
    rank_bytes = Counter(dict(zip(ranks, map(sum, zip(*per_field)))))
    trellis_bytes = Counter(dict(zip(ranks, cols.rank_bytes(layer_columns.TRELLIS))))
    tensors = sum(map(cols.present, layer_columns.TENSOR_FIELDS))
    proj_k: Counter[int] = Counter()
    expert_ks = cols.expert_ks().values()
    if all(len(ks) == 1 for ks in expert_ks):  # one K per expert: each of its projections holds it
        for ks in expert_ks:
            k = next(iter(ks))
            if k is not None:
                proj_k[k] += len(projs)
        return rank_bytes, trellis_bytes, tensors, proj_k
    lin_ks = cols.linear_ks()
    for start in range(0, n, len(ranks)):  # an (expert, projection) is a run of len(ranks) linears
        run = set(lin_ks[start:start + len(ranks)])
        k = run.pop() if len(run) == 1 else None
        if k is not None:
            proj_k[k] += 1
    return rank_bytes, trellis_bytes, tensors, proj_k


def _declared_projection_counts(layer: MoeLayer) -> dict[str, int] | None:
    """R7 and tensor_storage maps: how many (expert, projection) pairs are declared at each K."""
    if not layer.declared_projection_k:
        return None
    counts = Counter(layer.declared_projection_k.values())
    return {f"K{k}": n for k, n in sorted(counts.items(), key=lambda kv: str(kv[0]))}


_RUN_KEYS = ("partition", "k_values", "bpw", "bytes_per_rank", "trellis_bytes_per_rank", "rotation", "tensors",
             "projection_k", "declared_projection_k")


def collapse_runs(rows: Sequence[Mapping[str, Any]]) -> list[RunRow]:
    """Consecutive layers with the same partition, bpw, bytes, rotation and tensor count become one run."""
    groups: list[tuple[tuple[str, ...], list[Mapping[str, Any]]]] = []  # (what must be equal, its rows)
    for row in rows:
        key = tuple(str(row[k]) for k in _RUN_KEYS)
        if groups and groups[-1][0] == key and groups[-1][1][-1]["layer"] == row["layer"] - 1:
            groups[-1][1].append(row)
        else:
            groups.append((key, [row]))
    return [_run(members) for _, members in groups]


def _run(members: list[Mapping[str, Any]]) -> RunRow:
    first, layers = members[0], [row["layer"] for row in members]
    shards: list[str] = []
    for row in members:
        shards.extend(s for s in row["shards"] if s not in shards)
    tier_sets = {tuple(row["tiers"].items()) for row in members}
    return {"layers": layers, "shards": shards, "partition": first["partition"], "k_values": first["k_values"],
            "bpw": first["bpw"], "bytes_per_rank": first["bytes_per_rank"],
            "trellis_bytes_per_rank": first["trellis_bytes_per_rank"], "rotation": first["rotation"],
            "tensors": first["tensors"], "projection_k": first["projection_k"],
            "declared_projection_k": first["declared_projection_k"],
            "tiers": dict(next(iter(tier_sets))) if len(tier_sets) == 1 else None,  # None: membership varies
            "layer_range": compact_ranges(layers)}


def _decoder_layers(ckpt: Checkpoint) -> int | None:
    """config.json's num_hidden_layers: MoE layers from there on are MTP layers (None: not declared)."""
    n = ckpt.config.get("num_hidden_layers") if isinstance(ckpt.config, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def totals(ckpt: Checkpoint, rows: Sequence[Mapping[str, Any]]) -> Totals:
    # "Routed experts per rank", one definition with `trellis fit`: the decoder's MoE layers, the MTP layer apart.
    decoder = _decoder_layers(ckpt)
    mtp_rank = sum(r["bytes_per_rank"] for r in rows if decoder is not None and r["layer"] >= decoder)
    routed_rank = sum(r["bytes_per_rank"] for r in rows) - mtp_rank
    expert_names = _expert_tensor_bytes(ckpt)
    all_tensor_bytes = _bytes(ckpt.tensors.values())
    other = all_tensor_bytes - expert_names
    return {
        "layers": len(rows),
        "routed_bytes_per_rank": routed_rank,
        "mtp_routed_bytes_per_rank": mtp_rank,
        "routed_trellis_bytes_per_rank": sum(r["trellis_bytes_per_rank"] for r in rows),
        "checkpoint_bytes": sum(size for size in ckpt.files.values() if size > 0),
        "tensor_bytes": all_tensor_bytes,
        "non_routed_bytes": other,
        # Estimate: non-routed tensors (attention, shared expert, embeddings) split evenly over the TP ranks.
        "weights_per_rank_bytes": routed_rank + mtp_rank + other // max(ckpt.tp, 1),
        "tensors": len(ckpt.tensors),
        "files": len(ckpt.files),
    }


def _expert_tensor_bytes(ckpt: Checkpoint) -> int:
    total = 0
    for layer in ckpt.layers.values():
        cols = layer_columns.columns(layer)  # trellis, suh, svh, su, sv, mcg, mul1, then the extra fields
        if cols.layout() is not None:  # the layer rows' sums per rank (the same bytes)
            total += sum(sum(cols.rank_bytes(i)) for i in layer_columns.TENSOR_FIELDS)
        else:
            total += sum(_bytes(list(filter(None, cols.field(i)))) for i in layer_columns.TENSOR_FIELDS)
        total += _bytes(list(chain.from_iterable(cols.field(layer_columns.EXTRA))))
        total += sum(ref.nbytes for f in layer.shared_h.values() for ref in f.values())
        total += sum(ref.nbytes for ref in layer.r7_shared.values()) + sum(ref.nbytes for ref in layer.unparsed)
    return total


def _bytes(refs: Collection[TensorRef]) -> int:
    """The bytes of `refs`, summed in C (inspect sums ~935k tensors twice)."""
    ends: int = sum(map(_END, refs))
    begins: int = sum(map(_BEGIN, refs))
    return ends - begins


_BEGIN, _END = attrgetter("begin"), attrgetter("end")
