"""`trellis inspect` of an exl3-v1 checkpoint: the same per-layer rows as TR3 (partition, bpw, tiers, bytes per
rank), plus the container's slot layout: the TP degrees its extents allow and the bytes one rank reads at each
(rendered by inspect_report.render_exl3v1).

K per expert comes from the rate tables (uniform: the manifest's bits); an expert whose records use several
bit widths (P24, P43, or P33 in one pair and P44 in another) is counted under "mixed".
"""

from __future__ import annotations

from typing import Any, TypedDict

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.inspect_doc import Geometry, InspectSummary, RunRow, Totals
from trellis_cli.dialects.exl3v1.container import CODES, container, container_or_none, layer_rates
from trellis_cli.dialects.exl3v1.layout import hidden_table_bytes, rank_bytes, row_payloads, tp_degrees
from trellis_cli.dialects.exl3v1.schema import SLOT_CHANNELS
from trellis_cli.id_ranges import compact_ranges

MIXED = "mixed"


class Exl3v1Section(TypedDict):
    """The document's `exl3v1`: the container's slot layout, from its manifest."""

    manifest: str
    structure: str
    bits: int | None
    pair_kinds: list[str]
    num_slots: int
    row_alignment: int
    extent_alignment_slots: int
    extent_barriers: list[int]
    per_expert_input_rotations: bool
    intermediate_hadamard: bool
    tp_degrees: list[int]
    hidden_table_bytes: int


class Exl3v1LayerRow(TypedDict):
    """One layer (`layers`): the shard rows' keys, then what a slot-major layer file adds."""

    layer: int
    partition: str
    k_values: list[Any]  # K per tier, then MIXED for experts of several K
    experts: int
    bpw: float | None  # None: the layer has no rate table
    tiers: dict[str, str]
    projection_k: None
    declared_projection_k: None
    bytes_per_rank: int
    trellis_bytes_per_rank: int
    rank_bytes: dict[str, int]  # TP degree -> bytes one rank reads
    row_stride: int
    row_payload: int | None
    bytes_per_slot: int
    ranks: int
    rotation: str
    shards: list[str]
    tensors: int


class Exl3v1Document(InspectSummary):
    """The exl3-v1 inspect document, in its JSON key order (`declared` is empty: the manifest declares)."""

    geometry: Geometry
    declared: dict[str, Any]
    exl3v1: Exl3v1Section | None
    layers: list[Exl3v1LayerRow]
    runs: list[RunRow]
    totals: Totals
    parse_findings: list[dict[str, Any]]


def exl3v1_section(ckpt: Checkpoint) -> Exl3v1Section | None:
    m = container(ckpt).manifest
    if m is None:
        return None
    return {"manifest": container(ckpt).manifest_file, "structure": m.structure, "bits": m.bits,
            "pair_kinds": list(m.pair_kinds), "num_slots": m.num_slots, "row_alignment": m.row_alignment,
            "extent_alignment_slots": m.extent_alignment, "extent_barriers": list(m.barriers),
            "per_expert_input_rotations": m.per_expert_input_rotations,
            "intermediate_hadamard": m.intermediate_hadamard, "tp_degrees": tp_degrees(m),
            "hidden_table_bytes": hidden_table_bytes(m)}


def exl3v1_rows(ckpt: Checkpoint, chosen: list[int]) -> list[Exl3v1LayerRow]:
    box = container(ckpt)
    m = box.manifest
    if m is None:
        return []
    degrees = tp_degrees(m)
    rows: list[Exl3v1LayerRow] = []
    for index in chosen:
        layer = box.layers[index]
        codes = layer.ref(CODES)
        stride = codes.shape[1] if codes is not None and len(codes.shape) == 2 else 0
        rates = layer_rates(ckpt, index)
        tiers: dict[Any, list[int]] = {}
        bpw = None
        if rates is not None:
            for e in range(m.num_experts):
                k = rates.expert_k(e, m.num_slots)
                tiers.setdefault(k if k is not None else MIXED, []).append(e)
            bpw = round(sum(rates.expert_bpw(e, m.num_slots) for e in range(m.num_experts)) / m.num_experts, 3)
        ordered = sorted(tiers.items(), key=lambda kv: (isinstance(kv[0], str), kv[0]))
        payload = max(row_payloads(m, rates), default=0) if rates else None
        rows.append({
            "layer": index,
            "partition": "/".join(str(len(ids)) for _, ids in ordered) if ordered else "-",
            "k_values": [k for k, _ in ordered],
            "experts": m.num_experts,
            "bpw": bpw,
            "tiers": {(f"K{k}" if k != MIXED else MIXED): compact_ranges(ids) for k, ids in ordered},
            "projection_k": None,
            "declared_projection_k": None,
            "bytes_per_rank": rank_bytes(m, stride, 1),
            "trellis_bytes_per_rank": m.num_slots * stride,
            "rank_bytes": {str(tp): rank_bytes(m, stride, tp) for tp in degrees},
            "row_stride": stride,
            "row_payload": payload,
            "bytes_per_slot": stride + m.num_experts * 3 * SLOT_CHANNELS * 2,
            "ranks": 1,
            "rotation": ckpt.rotation_layout,
            "shards": [layer.file],
            "tensors": len(layer.tensors),
        })
    return rows


def exl3v1_document(ckpt: Checkpoint, layers: list[int] | None) -> Exl3v1Document:
    """The inspect document: the shared rows, runs and totals, plus the slot layout section and the bytes one
    rank reads at each allowed TP per run."""
    from trellis_cli.dialects.inspect_doc import collapse_runs, describe_source, totals
    from trellis_cli.selection import require_present

    chosen = list(ckpt.layers) if layers is None else require_present(layers, ckpt.layers)
    whole = layers is None
    rows = exl3v1_rows(ckpt, chosen)
    every = rows if whole else exl3v1_rows(ckpt, list(ckpt.layers))  # totals cover the whole checkpoint
    runs = collapse_runs(rows)
    for run in runs:  # bytes per rank at each TP degree: the same across a run (same stride)
        run["rank_bytes"] = next(r["rank_bytes"] for r in rows if r["layer"] == run["layers"][0])
    # unsliced: one rank holds the whole intermediate size (a TP cuts slot extents when read)
    geometry: Geometry = {"hidden": ckpt.hidden, "intermediate": ckpt.intermediate,
                          "intermediate_per_rank": ckpt.intermediate, "experts": ckpt.num_experts, "tp": 1,
                          "codebook": ckpt.codebook, "rotation_layout": ckpt.rotation_layout}
    whole_totals = totals(ckpt, every)  # the container's own counts: its layer files' tensors and every header's
    whole_totals["tensors"] = sum(r["tensors"] for r in every)
    whole_totals["tensor_bytes"] = sum(e.nbytes for h in ckpt.headers.values() for e in h.tensors.values())
    return {"dialect": ckpt.dialect, "source": describe_source(ckpt), "geometry": geometry,
            "declared": {}, "exl3v1": exl3v1_section(ckpt), "layers": rows, "runs": runs,
            "totals": whole_totals, "parse_findings": [f.to_dict() for f in ckpt.parse_findings]}


def codes_tables(ckpt: Checkpoint) -> dict[str, tuple[int, int]]:
    """Layer file -> (where its codes table starts, the routed weights it encodes: E * 3 * H * I). The table
    mixes K per expert, so `inspect --tensors` gives it a bpw (bytes over weights) and no K; BTX names it
    `atoms`: the model knows it as codes."""
    box = container_or_none(ckpt)
    if box is None or box.manifest is None:
        return {}
    m = box.manifest
    weights = m.num_experts * 3 * m.hidden * m.intermediate
    if not weights:
        return {}
    return {layer.file: (ref.begin, weights) for layer in box.layers.values() if (ref := layer.ref(CODES)) is not None}
