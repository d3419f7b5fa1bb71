"""What `trellis inspect` reports: per MoE layer the K partition, bpw, bytes per rank, tier membership,
rotation layout and shards; checkpoint totals; and runs of identical layers collapsed for reading.

The document is the dialect's answer (`build_inspect` -> a dialect's `InspectSummary`; the shared parts are dialects/inspect_doc.py);
the text and Markdown renderings here are pure functions of it.
"""

from __future__ import annotations

from typing import Any, Mapping

from trellis_cli.checkpoint import heap, layer_columns
from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.inspect_doc import InspectSummary, collapse_runs, layer_summary
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import counted


def build_inspect(ckpt: Checkpoint, layers: list[int] | None = None) -> InspectSummary:
    """The inspect document, as the checkpoint's dialect builds it (`Dialect.inspect_document`: the per-linear
    shard document of dialects/inspect_doc.py unless the dialect stores its layers another way)."""
    with heap.settled(), layer_columns.shared():  # the layer rows and totals read every linear
        return dialect_of(ckpt).inspect_document(ckpt, layers)


# ---- renderings ----------------------------------------------------------------------------------------

def routed_per_rank(totals: dict[str, Any]) -> str:
    """Routed experts per rank as `trellis fit` shows them: GiB (2^30, as GPU memory is counted), the decoder's MoE
    layers, the MTP layer apart; the decimal size beside it."""
    n, mtp = totals["routed_bytes_per_rank"], totals.get("mtp_routed_bytes_per_rank", 0)
    text = f"{n / 2**30:.2f} GiB ({human_bytes(n)}; decoder MoE layers"
    return text + (f", the MTP layer's {mtp / 2**30:.2f} GiB apart)" if mtp else ")")


def human_bytes(n: int) -> str:
    """Decimal units, as every command prints sizes (1 GB = 10^9 bytes); JSON carries exact bytes."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def render_exl3v1(doc: Mapping[str, Any]) -> list[str]:
    """Lines added to the text rendering: the slot layout and the bytes one rank reads per allowed TP."""
    x = doc.get("exl3v1")
    if not x:
        return []
    rates = f"uniform K{x['bits']}" if x["structure"] == "uniform" else f"per_expert_pair {x['pair_kinds']}"
    lines = [f"{doc.get('dialect') or 'exl3-v1'}: {x['num_slots']} slots of 32 channels, rates {rates}, row alignment {x['row_alignment']}, "
             f"extent alignment {x['extent_alignment_slots']} slots, barriers {x['extent_barriers'] or 'none'}",
             f"TP degrees the slot layout allows: {', '.join(map(str, x['tp_degrees'])) or 'none'}"]
    for run in doc["runs"]:
        per_tp = ", ".join(f"tp{tp} {human_bytes(n)}" for tp, n in (run.get("rank_bytes") or {}).items())
        lines.append(f"  {run['layer_range']}: bytes per rank: {per_tp or '-'}")
    return lines


def _run_label(run: Mapping[str, Any]) -> str:
    n = len(run["layers"])
    return f"layer {run['layer_range']}" if n == 1 else f"layers {run['layer_range']} ({n})"


def _shards_text(shards: list[str]) -> str:
    if len(shards) > 2:
        return f"{shards[0]} ... {shards[-1]} ({len(shards)} files)"
    return ", ".join(shards) or "-"


def _tiers_text(run: Mapping[str, Any]) -> str:
    if run["tiers"] is None:
        return "tier membership varies by layer (inspect --layers N or --json for ids)"
    return "; ".join(f"{k}: {ids}" for k, ids in run["tiers"].items())


def render_text(doc: Mapping[str, Any]) -> list[str]:
    if "route_pack" in doc:
        return _render_route_pack(doc)
    g, src, t = doc["geometry"], doc["source"], doc["totals"]
    lines = [f"source: {_source_line(src)}",
             f"dialect: {doc['dialect']} (rotation {g['rotation_layout']}, codebook {g['codebook']}, tp {g['tp']})",
             f"geometry: hidden {g['hidden']}, intermediate {g['intermediate']} ({g['intermediate_per_rank']} per "
             f"rank), {g['experts']} experts per layer"]
    if doc["declared"]:
        lines.append("declared: " + ", ".join(f"{k}={v}" for k, v in doc["declared"].items()))
    lines.append("")
    for run in doc["runs"]:
        k_part = "/".join(f"K{k}" for k in run["k_values"])
        lines.append(f"{_run_label(run)}: {run['partition']} ({k_part}), {run['bpw']} bpw, "
                     f"{human_bytes(run['bytes_per_rank'])} per rank, {run['rotation']}, {run['tensors']} tensors")
        lines.append(f"    {_tiers_text(run)}")
        lines.append(f"    shards: {_shards_text(run['shards'])}")
        if run.get("projection_k"):
            lines.append(f"    per-projection K counts: {run['projection_k']}")
        if run.get("declared_projection_k"):
            lines.append(f"    declared (expert, projection) K counts: {run['declared_projection_k']}")
    selection = doc.get("selection")
    if selection:
        lines += ["", f"selected layers {selection['layers']}: routed experts per rank "
                      f"{human_bytes(selection['routed_bytes_per_rank'])} "
                      f"(trellis {human_bytes(selection['routed_trellis_bytes_per_rank'])})"]
    lines += ["", f"totals (whole checkpoint): {counted(t['layers'], 'MoE layers')}, {counted(t['tensors'], 'tensors')} "
                    f"in {counted(t['files'], 'files')}",
              f"  routed experts per rank: {routed_per_rank(t)} "
              f"(trellis {human_bytes(t['routed_trellis_bytes_per_rank'])})",
              f"  whole checkpoint: {human_bytes(t['checkpoint_bytes'])}",
              f"  weights per rank (estimate): {human_bytes(t['weights_per_rank_bytes'])}"]
    if doc.get("exl3v1"):
        lines += ["", *render_exl3v1(doc)]
    if doc["parse_findings"]:
        lines.append(f"note: {len(doc['parse_findings'])} problem(s) while parsing; run `trellis validate`")
    return lines


def render_markdown(doc: Mapping[str, Any]) -> list[str]:
    if "route_pack" in doc:
        return ["```", *_render_route_pack(doc), "```"]
    g, t = doc["geometry"], doc["totals"]
    lines = [f"**Source:** {_source_line(doc['source'])}  ",
             f"**Dialect:** `{doc['dialect']}`, rotation `{g['rotation_layout']}`, codebook `{g['codebook']}`, "
             f"TP {g['tp']}, H {g['hidden']}, I {g['intermediate']}, {g['experts']} experts",
             "", "| layers | partition | bpw | bytes per rank | rotation | tensors | tiers | shards |",
             "|---|---|---|---|---|---|---|---|"]
    for run in doc["runs"]:
        k_part = "/".join(f"K{k}" for k in run["k_values"])
        lines.append(f"| {run['layer_range']} | {run['partition']} ({k_part}) | {run['bpw']} | "
                     f"{human_bytes(run['bytes_per_rank'])} | {run['rotation']} | {run['tensors']} | "
                     f"{_tiers_text(run)} | {_shards_text(run['shards'])} |")
    lines += ["", f"Whole checkpoint: routed experts per rank **{routed_per_rank(t)}**; "
              f"{human_bytes(t['checkpoint_bytes'])}; weights per rank (estimate) "
              f"{human_bytes(t['weights_per_rank_bytes'])}; {t['tensors']} tensors in {t['files']} files."]
    return lines


def _source_line(src: dict[str, Any]) -> str:
    where = src.get("repo_id") or src.get("path") or src.get("kind") or "?"
    return f"{where}@{src['revision']}" if src.get("revision") else str(where)


def _render_route_pack(doc: Mapping[str, Any]) -> list[str]:
    pack, g = doc["route_pack"], doc["route_pack"]["geometry"]
    lines = [f"source: {_source_line(doc['source'])}", f"dialect: {doc['dialect']} v{pack.get('schema_version')} "
             f"(rotation {g['rotation_layout']}, codebook {g['codebook']}, tp {g['tp']})",
             f"repacked from: {_source_line(pack.get('source') or {})} ({(pack.get('source') or {}).get('dialect')})",
             f"geometry: hidden {g['hidden']}, intermediate {g['intermediate']} ({g['intermediate_per_rank']} per "
             f"rank), {g['experts']} experts per layer"]
    if doc.get("purpose"):
        lines.append(f"purpose: {doc['purpose']}")
    lines.append("")
    for layer in pack.get("layers", []):
        k_part = "/".join(f"K{k}" for k in layer["k_values"])
        lines.append(f"layer {layer['layer']}: {layer['partition']} ({k_part}), {layer.get('bpw')} bpw")
        lines.append("    " + "; ".join(f"{k}: {ids}" for k, ids in layer["tiers"].items()))
    lines += ["", f"totals: {counted(len(pack.get('layers', [])), 'MoE layers')}, {counted(pack.get('files', 0), 'files')}, "
              f"{human_bytes(pack.get('total_bytes', 0))}"]
    return lines


__all__ = ["build_inspect", "collapse_runs", "layer_summary", "render_markdown", "render_text"]
