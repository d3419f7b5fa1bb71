"""What `trellis inspect` reports: per MoE layer the K partition, bpw, bytes per rank, tier membership,
rotation layout and shards; checkpoint totals; and runs of identical layers collapsed for reading.

Built from the checkpoint model only (headers and JSON), so it works header-only on a remote checkpoint.
Plain data out (`build_inspect` -> dict); text and Markdown renderings are pure functions of that dict.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint, MoeLayer
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import counted
from trellis_cli.id_ranges import compact_ranges


def build_inspect(ckpt: Checkpoint, layers: list[int] | None = None) -> dict[str, Any]:
    """The inspect document; its shape is the one the dialect's `inspect_view` names."""
    view = dialect_of(ckpt).inspect_view
    if view == "route-pack":
        from trellis_cli.dialects.routepack.verify import describe_repacked

        pack = _as_tr3_terms(describe_repacked(ckpt.source))
        if layers is not None:  # as for a checkpoint: every chosen layer must be there, and only those show
            from trellis_cli.selection import require_present

            require_present(layers, [row["layer"] for row in pack.get("layers", [])])
            pack["layers"] = [row for row in pack.get("layers", []) if row["layer"] in layers]
        from trellis_cli.dialects.routepack import PURPOSE

        return {"dialect": ckpt.dialect, "source": _describe_source(ckpt), "route_pack": pack, "purpose": PURPOSE}
    from trellis_cli.selection import require_present

    chosen = list(ckpt.layers) if layers is None else require_present(layers, ckpt.layers)
    if view == "slot-rows":
        return _exl3v1_document(ckpt, chosen, whole=layers is None)
    rows = [layer_summary(ckpt, ckpt.layers[li]) for li in chosen]
    # Totals describe the whole checkpoint, whatever --layers shows; the selection gets its own.
    every = rows if layers is None else [layer_summary(ckpt, moe) for moe in ckpt.layers.values()]
    document = {
        "dialect": ckpt.dialect,
        "source": _describe_source(ckpt),
        "geometry": {"hidden": ckpt.hidden, "intermediate": ckpt.intermediate,
                     "intermediate_per_rank": ckpt.intermediate_per_rank, "experts": ckpt.num_experts, "tp": ckpt.tp,
                     "codebook": ckpt.codebook, "rotation_layout": ckpt.rotation_layout},
        "declared": _declared_keys(ckpt),
        "layers": rows,
        "runs": collapse_runs(rows),
        "totals": _totals(ckpt, every),
        "parse_findings": [f.to_dict() for f in ckpt.parse_findings],
    }
    if layers is not None:
        document["selection"] = {"layers": compact_ranges(chosen),
                                 "routed_bytes_per_rank": sum(r["bytes_per_rank"] for r in rows),
                                 "routed_trellis_bytes_per_rank": sum(r["trellis_bytes_per_rank"] for r in rows)}
    return document


def _as_tr3_terms(pack: dict[str, Any]) -> dict[str, Any]:
    """A route pack's description with the keys and notation of a TR3 inspect (the manifest on disk keeps its
    own names): geometry as hidden / intermediate / intermediate_per_rank / experts, tiers as K -> id ranges."""
    g = pack.get("geometry") or {}
    tp = pack.get("tp")
    per_rank = g.get("intermediate_rank")
    pack["geometry"] = {"hidden": g.get("hidden"),
                        "intermediate": g.get("intermediate", per_rank * tp if per_rank and tp else None),
                        "intermediate_per_rank": per_rank, "experts": g.get("num_experts"), "tp": tp,
                        "codebook": pack.get("codebook"), "rotation_layout": pack.get("rotation")}
    for layer in pack.get("layers", []):
        tiers = layer.pop("tiers", [])
        layer.update(partition="/".join(str(t.get("size")) for t in tiers) or "-",
                     k_values=[t.get("k") for t in tiers], experts=sum(t.get("size", 0) for t in tiers),
                     tiers={f"K{t.get('k')}": t.get("experts") for t in tiers})
    return pack


def _exl3v1_document(ckpt: Checkpoint, chosen: list[int], whole: bool) -> dict[str, Any]:
    from trellis_cli.dialects.exl3v1.inspect import exl3v1_rows, exl3v1_section

    rows = exl3v1_rows(ckpt, chosen)
    every = rows if whole else exl3v1_rows(ckpt, list(ckpt.layers))  # totals cover the whole checkpoint
    runs = collapse_runs(rows)
    for run in runs:  # bytes per rank at each TP degree: the same across a run (same stride)
        run["rank_bytes"] = next(r["rank_bytes"] for r in rows if r["layer"] == run["layers"][0])
    return {"dialect": ckpt.dialect, "source": _describe_source(ckpt),
            "geometry": {"hidden": ckpt.hidden, "intermediate": ckpt.intermediate,
                         "intermediate_per_rank": ckpt.intermediate, "experts": ckpt.num_experts, "tp": 1,
                         "codebook": ckpt.codebook, "rotation_layout": ckpt.rotation_layout},
            "declared": {}, "exl3v1": exl3v1_section(ckpt), "layers": rows, "runs": runs,
            "totals": {**_totals(ckpt, every), "tensors": sum(r["tensors"] for r in every),
                       "tensor_bytes": sum(e.nbytes for h in ckpt.headers.values() for e in h.tensors.values())},
            "parse_findings": [f.to_dict() for f in ckpt.parse_findings]}


def _describe_source(ckpt: Checkpoint) -> dict[str, Any]:
    describe = getattr(ckpt.source, "describe", None)
    info = describe() if describe else {"path": str(ckpt.source)}
    info.setdefault("revision", getattr(ckpt.source, "revision", None))
    return info


def _declared_keys(ckpt: Checkpoint) -> dict[str, Any]:
    hybrid = ckpt.declared.get("hybrid_tr3_tail") or {}
    keys = ("format", "bits", "k_values", "bits_per_expert", "codebook", "experts_per_layer", "moe_layers", "tp",
            "rotation_layout")
    out = {k: hybrid[k] for k in keys if k in hybrid}
    q = ckpt.config.get("quantization_config")
    if isinstance(q, dict):
        out["quant_method"] = q.get("quant_method")
        if q.get("scope") is not None:  # a scope (GLM-5.3's unsliced stream) declares its one K there
            out["scope"] = q["scope"]
            out.setdefault("bits", q.get("bits"))
    sources = sorted(set((ckpt.declared.get("k_source") or {}).values()))
    if sources:
        out["k_source"] = sources
    return out


def layer_summary(ckpt: Checkpoint, layer: MoeLayer) -> dict[str, Any]:
    tiers = layer.partition()
    n_experts = sum(len(ids) for ids in tiers.values())
    rank_bytes: Counter[int] = Counter()
    trellis_bytes: Counter[int] = Counter()
    tensors = 0
    proj_k: Counter[int] = Counter()
    for projs in layer.experts.values():
        for by_rank in projs.values():
            ks = {lin.k for lin in by_rank.values()}
            if len(ks) == 1 and None not in ks:
                proj_k[ks.pop()] += 1
            for rank, lin in by_rank.items():
                for ref in (lin.trellis, lin.suh, lin.svh, lin.su, lin.sv, lin.mcg, lin.mul1, *lin.extra):
                    if ref is not None:
                        rank_bytes[rank] += ref.nbytes
                        tensors += 1
                if lin.trellis is not None:
                    trellis_bytes[rank] += lin.trellis.nbytes
    for (_, rank), fields in layer.shared_h.items():
        for ref in fields.values():
            rank_bytes[rank] += ref.nbytes
            tensors += 1
    bpw = sum(k * n for k, n in proj_k.items()) / max(sum(proj_k.values()), 1)
    per_projection = len({k for k in proj_k}) > len(tiers) or any(layer.expert_k(e) is None for e in layer.experts)
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


def _declared_projection_counts(layer: MoeLayer) -> dict[str, int] | None:
    """R7 and tensor_storage maps: how many (expert, projection) pairs are declared at each K."""
    if not layer.declared_projection_k:
        return None
    counts = Counter(layer.declared_projection_k.values())
    return {f"K{k}": n for k, n in sorted(counts.items(), key=lambda kv: str(kv[0]))}


_RUN_KEYS = ("partition", "k_values", "bpw", "bytes_per_rank", "trellis_bytes_per_rank", "rotation", "tensors",
             "projection_k", "declared_projection_k")


def collapse_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive layers with the same partition, bpw, bytes, rotation and tensor count become one run."""
    runs: list[dict[str, Any]] = []
    for row in rows:
        key = tuple(str(row[k]) for k in _RUN_KEYS)
        if runs and runs[-1]["_key"] == key and runs[-1]["layers"][-1] == row["layer"] - 1:
            runs[-1]["layers"].append(row["layer"])
            runs[-1]["_tiers"].add(tuple(row["tiers"].items()))
            runs[-1]["shards"].extend(s for s in row["shards"] if s not in runs[-1]["shards"])
            continue
        runs.append({"_key": key, "layers": [row["layer"]], "_tiers": {tuple(row["tiers"].items())},
                     "shards": list(row["shards"]), **{k: row[k] for k in _RUN_KEYS}})
    for run in runs:
        run.pop("_key")
        tier_sets = run.pop("_tiers")
        run["tiers"] = dict(next(iter(tier_sets))) if len(tier_sets) == 1 else None  # None: membership varies
        run["layer_range"] = compact_ranges(run["layers"])
    return runs


def _decoder_layers(ckpt: Checkpoint) -> int | None:
    """config.json's num_hidden_layers: MoE layers from there on are MTP layers (None: not declared)."""
    n = ckpt.config.get("num_hidden_layers") if isinstance(ckpt.config, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def _totals(ckpt: Checkpoint, rows: list[dict[str, Any]]) -> dict[str, Any]:
    # "Routed experts per rank", one definition with `trellis fit`: the decoder's MoE layers, the MTP layer apart.
    decoder = _decoder_layers(ckpt)
    mtp_rank = sum(r["bytes_per_rank"] for r in rows if decoder is not None and r["layer"] >= decoder)
    routed_rank = sum(r["bytes_per_rank"] for r in rows) - mtp_rank
    expert_names = _expert_tensor_bytes(ckpt)
    all_tensor_bytes = sum(ref.nbytes for ref in ckpt.tensors.values())
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
        for projs in layer.experts.values():
            for by_rank in projs.values():
                for lin in by_rank.values():
                    total += sum(ref.nbytes for ref in (lin.trellis, lin.suh, lin.svh, lin.su, lin.sv, lin.mcg,
                                                        lin.mul1, *lin.extra) if ref is not None)
        total += sum(ref.nbytes for f in layer.shared_h.values() for ref in f.values())
        total += sum(ref.nbytes for ref in layer.r7_shared.values()) + sum(ref.nbytes for ref in layer.unparsed)
    return total


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


def render_exl3v1(doc: dict[str, Any]) -> list[str]:
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


def _run_label(run: dict[str, Any]) -> str:
    n = len(run["layers"])
    return f"layer {run['layer_range']}" if n == 1 else f"layers {run['layer_range']} ({n})"


def _shards_text(shards: list[str]) -> str:
    if len(shards) > 2:
        return f"{shards[0]} ... {shards[-1]} ({len(shards)} files)"
    return ", ".join(shards) or "-"


def _tiers_text(run: dict[str, Any]) -> str:
    if run["tiers"] is None:
        return "tier membership varies by layer (inspect --layers N or --json for ids)"
    return "; ".join(f"{k}: {ids}" for k, ids in run["tiers"].items())


def render_text(doc: dict[str, Any]) -> list[str]:
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


def render_markdown(doc: dict[str, Any]) -> list[str]:
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


def _render_route_pack(doc: dict[str, Any]) -> list[str]:
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
