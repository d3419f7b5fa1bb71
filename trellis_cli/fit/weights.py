"""Weight bytes per rank, exact to the byte, from tensor headers (docs/fit.md, "Weights").

Every tensor of the checkpoint is placed by the engine's sharding table: a rank-sliced routed expert on its
own rank, anything else sliced or replicated as the engine loads it. Routed experts are also counted per K
tier (how many experts at each K on the rank, and their bytes), which is what the demotion remedy reads.
The MTP layers (stored from layer `num_hidden_layers` on) count only when the engine loads them.

Parts of the model that the architecture has but the checkpoint does not store (a synthetic or experts-only
checkpoint) are estimated at bf16 from config.json through the same table and kept apart (`absent`), so the
header bytes stay exact and the estimate is named.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import ShardColumns
from trellis_cli.checkpoint.tensor_map import outside_experts
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.checkpoint.names import KIND_LINEAR, KIND_R7_SHARED, KIND_SHARED_H, parse_expert_name
from trellis_cli.errors import UsageError
from trellis_cli.fit.arch import Arch
from trellis_cli.fit.sharding import (COLUMN, EXPERT, PART_EXPERTS, PART_MTP, PARTS, REPLICATED, ROW, VOCAB, WHOLE,
                                      Rule, classify, layer_of, share, slice_bytes, split_of)

BF16 = 2
# vLLM's MTP layer reuses the main model's embedding and lm_head (deepseek_mtp.py: the shared_head.head and
# embed_tokens of DeepSeekMultiTokenPredictorLayer are tied to the target model's): a stored copy is not loaded.
MTP_SHARED = re.compile(r"\.(embed_tokens|shared_head\.head)\.")
RANK_SLICED = "rank-sliced"  # the style of a rank-sliced checkpoint's expert tensors: each on its own rank


@dataclass
class Tier:
    experts: int = 0  # expert-layers at this K on the rank
    bytes: int = 0


@dataclass
class RankWeights:
    rank: int
    parts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PARTS, 0))
    # K -> experts and bytes on this rank; None: layer-shared expert tensors (shared-H rows, exl3-v1 tables)
    tiers: dict[int | None, Tier] = field(default_factory=dict)
    absent: dict[str, int] = field(default_factory=dict)  # part -> estimated bytes, parts not in the checkpoint

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def expert_bytes(self) -> int:
        return self.parts[PART_EXPERTS]

    @property
    def absent_total(self) -> int:
        return sum(self.absent.values())

    def tier(self, k: int | None) -> Tier:
        return self.tiers.setdefault(k, Tier())


@dataclass
class Weights:
    tp: int
    ranks: list[RankWeights]
    styles: dict[str, set[str]]  # part -> the parallel styles its tensors have
    mtp_loaded: bool
    mtp_skipped_bytes: int  # bytes of MTP layers in the checkpoint that the engine does not load
    resliced: bool  # a rank-sliced checkpoint evaluated at another TP (an estimate: it needs re-slicing)
    present: set[str] = field(default_factory=set)  # parts the checkpoint stores (MTP layers included)
    mtp_shared_bytes: int = 0  # MTP copies of embed_tokens / shared_head.head: the main model's, never loaded twice


@dataclass
class _Bucket:
    nbytes: int = 0
    experts: int = 0  # expert-layers whose gate trellis is in this bucket


@dataclass
class Inventory:
    """Every tensor the checkpoint holds, summed into buckets that place the same way at any TP: read once,
    placed for each TP a remedy asks about."""

    sliced_tp: int | None  # the TP a rank-sliced checkpoint was cut for
    rules: tuple[Rule, ...]  # the engine's sharding table
    # (shown part, part, MTP layer, K or None, rank of a rank-sliced tensor or None, split kind, split length)
    buckets: dict[tuple, _Bucket] = field(default_factory=dict)
    styles: dict[str, set[str]] = field(default_factory=dict)
    present: set[str] = field(default_factory=set)  # parts the checkpoint stores (MTP layers included)
    mtp_shared_bytes: int = 0  # the MTP layer's embed_tokens / shared_head.head: shared with the main model

    def add(self, key: tuple, nbytes: int, experts: int = 0) -> None:
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket()
        bucket.nbytes += nbytes
        bucket.experts += experts


def scan(ckpt: Checkpoint, arch: Arch, rules: tuple[Rule, ...]) -> Inventory:
    """Read every header tensor once into an Inventory (exl3-v1 layer files are placed per TP instead)."""
    sliced_tp = ckpt.tp if any(layer.rank_sliced for layer in ckpt.layers.values()) else None
    loose = dialect_of(ckpt).loose_tensors(ckpt)
    if loose is not None:  # the layers are a container's files (placed per TP by rank_weights); the rest here
        inv = Inventory(None, rules)
        tensors: Iterable[tuple[str, tuple[int, ...], int]] = ((ref.name, tuple(ref.shape), ref.nbytes)
                                                                for ref in loose)
    else:
        fast = _scan_rank_sliced(ckpt, arch, rules, sliced_tp)
        if fast is not None:
            return fast
        inv = Inventory(sliced_tp, rules)
        tensors = ((ref.name, ref.shape, ref.nbytes) for ref in ckpt.tensors.values())
    _scan_tensors(ckpt, arch, inv, tensors)
    return inv


def _scan_rank_sliced(ckpt: Checkpoint, arch: Arch, rules: tuple[Rule, ...], sliced_tp: int | None) -> Inventory | None:
    """`scan` of a rank-sliced checkpoint whose routed-expert tensors are all fields of rank-sliced linears (the
    production layout, ~935k tensors): each linear's bytes summed from the model's layers (one step per linear,
    every one of its tensors placing the same way), the other tensors one by one as `scan` places them. None
    where that does not prove the same inventory (any other expert tensor, a style `scan` would leave
    order-dependent): `scan` then reads every tensor."""
    if sliced_tp is None:
        return None
    others = outside_experts(ckpt.tensors)
    linears = 0
    for layer in ckpt.layers.values():
        if layer.index >= 10 ** MAX_LAYER_DIGITS_FIT:
            return None  # `scan` refuses such a layer number by name
        for projs in layer.experts.values():
            for by_rank in projs.values():
                for lin in by_rank.values():
                    linears += 7 - lin[:7].count(None) + len(lin.extra)
    if linears != len(ckpt.tensors) - len(others):
        return None
    inv = Inventory(sliced_tp, rules)
    _scan_tensors(ckpt, arch, inv, ((ref.name, ref.shape, ref.nbytes) for ref in others))
    if any(EXPERT in styles for styles in inv.styles.values()):
        return None  # a style the per-tensor order decides
    for layer in ckpt.layers.values():
        is_mtp = layer.index >= arch.layers
        shown = PART_MTP if is_mtp else PART_EXPERTS
        for expert, projs in layer.experts.items():
            k = layer.expert_k(expert)
            for proj, by_rank in projs.items():
                for rank, lin in by_rank.items():
                    refs = [ref for ref in lin[:7] if ref is not None] + list(lin.extra)
                    if lin.prefix != f"model.layers.{layer.index}.mlp.experts.{expert}.{proj}.rank{rank}" or \
                            (rank == 0 and not all(".rank0." in ref.name for ref in refs)):
                        return None  # another spelling, or a name without its rank segment: placed otherwise
                    nbytes = sum(ref.end - ref.begin for ref in refs)
                    counted = int(proj == "gate_proj" and lin.trellis is not None)
                    inv.present.add(PART_EXPERTS)
                    styles = inv.styles.setdefault(shown, set())
                    styles.add(RANK_SLICED)
                    inv.add((shown, PART_EXPERTS, is_mtp, k, rank, WHOLE, 0), nbytes, counted)
    return inv


def scan_columns(ckpt: Checkpoint, arch: Arch, rules: tuple[Rule, ...], shards: ShardColumns) -> Inventory | None:
    """`scan` of a rank-sliced checkpoint read as columns (`reader.shard_columns`): each shard of experts one MoE
    layer's canonical rank-sliced linears, the other shards no expert tensor. The same inventory as
    `_scan_rank_sliced` builds from the model, without a record per tensor; None where that is not proven (a
    layer in two shards, a name in two shards, a style the per-tensor order decides): the caller opens in full."""
    if not shards.linears:
        return None
    layers = [found.layer for found in shards.linears.values()]
    if len(set(layers)) != len(layers) or max(layers) >= 10 ** MAX_LAYER_DIGITS_FIT:
        return None
    others = [ref for header in shards.others.values() for ref in header.tensors.values()]
    if len({ref.name for ref in others}) != len(others):
        return None  # a name in two shards: the index or the file order picks one
    inv = Inventory(ckpt.tp, rules)
    _scan_tensors(ckpt, arch, inv, ((ref.name, ref.shape, ref.nbytes) for ref in others))
    if any(EXPERT in styles for styles in inv.styles.values()):
        return None
    for found in shards.linears.values():
        is_mtp = found.layer >= arch.layers
        shown = PART_MTP if is_mtp else PART_EXPERTS
        inv.present.add(PART_EXPERTS)
        inv.styles.setdefault(shown, set()).add(RANK_SLICED)
        for (k, rank), (nbytes, gates) in found.tiers.items():  # (summed per K and rank as the shard was read)
            inv.add((shown, PART_EXPERTS, is_mtp, k, rank, WHOLE, 0), nbytes, gates)
    return inv


MAX_LAYER_DIGITS_FIT = 12  # sharding.MAX_LAYER_DIGITS: a longer layer number is refused by `layer_of`


def _scan_tensors(ckpt: Checkpoint, arch: Arch, inv: Inventory,
                  tensors: Iterable[tuple[str, tuple[int, ...], int]]) -> None:
    k_of: dict[tuple[int, int], int | None] = {}
    for name, shape, nbytes in tensors:
        layer = layer_of(name)
        is_mtp = layer is not None and layer >= arch.layers
        if is_mtp and MTP_SHARED.search(name):
            inv.mtp_shared_bytes += nbytes
            continue
        part, style = (PART_EXPERTS, EXPERT) if ".mlp.experts." in name else classify(inv.rules, name)
        shown = PART_MTP if is_mtp else part
        inv.present.add(part)
        inv.styles.setdefault(shown, set()).add(style)
        if part != PART_EXPERTS:
            inv.add((shown, part, is_mtp, None, None, *split_of(name, shape, style)), nbytes)
            continue
        parsed = parse_expert_name(name)
        k, counted, owner = None, 0, None
        if parsed is not None and parsed.kind == KIND_LINEAR and parsed.expert is not None:  # a linear names one
            key = (parsed.layer, parsed.expert)
            if key not in k_of:
                moe = ckpt.layers.get(parsed.layer)
                k_of[key] = moe.expert_k(parsed.expert) if moe is not None else None
            k = k_of[key]
            counted = int(parsed.field == "trellis" and parsed.projection == "gate_proj")
        if parsed is not None and parsed.kind in (KIND_LINEAR, KIND_SHARED_H, KIND_R7_SHARED):
            owner = parsed.rank
        if owner is not None and inv.sliced_tp is not None:
            split = (WHOLE, 0)
            inv.styles[shown].discard(EXPERT)
            inv.styles[shown].add(RANK_SLICED)
        else:
            owner = None
            unsliced = EXPERT if parsed is not None and parsed.kind == KIND_LINEAR else REPLICATED
            split = split_of(name, shape, unsliced)
        inv.add((shown, part, is_mtp, k, owner, *split), nbytes, counted)


def rank_weights(ckpt: Checkpoint, arch: Arch, inv: Inventory, tp: int, mtp: bool, reslice: bool = False) -> Weights:
    """Bytes per rank of every tensor the engine loads at `tp`.

    A rank-sliced checkpoint loads only at its own TP; with `reslice` another TP is estimated as if the
    checkpoint were re-sliced (each rank gets an equal share of the sliced bytes).
    """
    sliced_tp = inv.sliced_tp
    if sliced_tp is not None and sliced_tp != tp and not reslice:
        raise UsageError(f"the checkpoint is sliced for TP {sliced_tp} (config.json hybrid_tr3_tail.tp) and --tp is "
                         f"{tp}: the loaders refuse a rank-sliced checkpoint at another TP (re-slice it with "
                         f"`trellis repack SOURCE OUT --to tr3 --tp {tp}`)")
    out = Weights(tp, [RankWeights(r) for r in range(tp)], {k: set(v) for k, v in inv.styles.items()}, mtp, 0,
                  sliced_tp is not None and sliced_tp != tp, set(inv.present), inv.mtp_shared_bytes if mtp else 0)
    for (shown, part, is_mtp, k, owner, kind, length), bucket in inv.buckets.items():
        if is_mtp and not mtp:
            out.mtp_skipped_bytes += bucket.nbytes
            continue
        if owner is None:
            targets = [(rw, share(kind, length, bucket.nbytes, tp), bucket.experts) for rw in out.ranks]
        elif sliced_tp == tp:
            targets = [(out.ranks[owner], bucket.nbytes, bucket.experts)] if owner < tp else []
        else:  # estimate at another TP: every rank an equal share of each slice
            targets = [(rw, bucket.nbytes // tp, bucket.experts if owner == 0 else 0) for rw in out.ranks]
        for rw, b, experts in targets:
            rw.parts[shown] += b
            if part == PART_EXPERTS and not is_mtp:
                tier = rw.tier(k)
                tier.bytes += b
                tier.experts += experts
    _placed_by_container(ckpt, arch, out, mtp)
    _estimate_absent(arch, out, inv.rules)
    return out


def _placed_by_container(ckpt: Checkpoint, arch: Arch, out: Weights, mtp: bool) -> bool:
    """Layers a container places per rank itself (an exl3-v1's slot extents: `Dialect.layer_shares`), added to
    `out`; False when the checkpoint's layers are tensors the sharding table placed."""
    shares = dialect_of(ckpt).layer_shares(ckpt, out.tp, rates_below=arch.layers)
    if shares is None:
        return False
    for layer in shares:
        is_mtp = layer.layer >= arch.layers
        if is_mtp and not mtp:
            out.mtp_skipped_bytes += layer.nbytes
            continue
        part = PART_MTP if is_mtp else PART_EXPERTS
        out.styles.setdefault(part, set()).add(EXPERT)
        out.present.add(PART_EXPERTS)
        for rw, share in zip(out.ranks, layer.ranks):
            rw.parts[part] += share.nbytes
            if is_mtp:
                continue
            in_tiers = 0
            for k, b in share.experts or ():
                tier = rw.tier(k)
                tier.experts += 1
                tier.bytes += b
                in_tiers += b
            rw.tier(None).bytes += share.nbytes - in_tiers
    return True


# ---- what the checkpoint does not hold ------------------------------------------------------------------

def model_tensors(arch: Arch, mtp: bool) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, how many layers have it) of every non-routed-expert tensor of the architecture, in the GLM
    MoE DSA naming: one dense, one MoE and one MTP layer stand for all of their kind (no loop over layers,
    whatever num_hidden_layers says)."""
    h, out = arch.hidden, []
    qk = arch.qk_nope + arch.qk_rope
    shared_i = arch.moe_intermediate * arch.shared_experts
    dense = min(arch.first_dense, arch.layers)
    kinds = [(0, dense, "dense"), (dense, arch.layers - dense, "moe")]
    if mtp and arch.mtp_layers:
        kinds.append((arch.layers, arch.mtp_layers, "mtp"))
    for layer, count, kind in kinds:
        if count <= 0:
            continue
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        rows = [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (a + "kv_a_proj_with_mqa.weight", (arch.kv_lora_rank + arch.qk_rope, h)),
                (a + "kv_a_layernorm.weight", (arch.kv_lora_rank,)),
                (a + "kv_b_proj.weight", (arch.heads * (arch.qk_nope + arch.v_head), arch.kv_lora_rank)),
                (a + "o_proj.weight", (h, arch.heads * arch.v_head))]
        if arch.q_lora_rank:
            rows += [(a + "q_a_proj.weight", (arch.q_lora_rank, h)), (a + "q_a_layernorm.weight", (arch.q_lora_rank,)),
                     (a + "q_b_proj.weight", (arch.heads * qk, arch.q_lora_rank))]
        else:
            rows.append((a + "q_proj.weight", (arch.heads * qk, h)))
        if arch.index_head_dim and arch.index_heads:
            ix, d = a + "indexer.", arch.index_head_dim
            rows += [(ix + "wq_b.weight", (arch.index_heads * d, arch.q_lora_rank or h)), (ix + "wk.weight", (d, h)),
                     (ix + "k_norm.weight", (d,)), (ix + "k_norm.bias", (d,)),
                     (ix + "weights_proj.weight", (arch.index_heads, h))]
        if kind == "dense":
            i = arch.dense_intermediate or 0
            rows += [(p + f"mlp.{proj}.weight", (i, h)) for proj in ("gate_proj", "up_proj")]
            rows.append((p + "mlp.down_proj.weight", (h, i)))
        else:
            rows += [(p + "mlp.gate.weight", (arch.experts, h)), (p + "mlp.gate.e_score_correction_bias", (arch.experts,))]
            if shared_i:
                rows += [(p + f"mlp.shared_experts.{proj}.weight", (shared_i, h)) for proj in ("gate_proj", "up_proj")]
                rows.append((p + "mlp.shared_experts.down_proj.weight", (h, shared_i)))
        if kind == "mtp":  # the MTP layer's own modules
            rows += [(p + "enorm.weight", (h,)), (p + "hnorm.weight", (h,)), (p + "eh_proj.weight", (h, 2 * h)),
                     (p + "shared_head.norm.weight", (h,))]
        out += [(name, shape, count) for name, shape in rows]
    out += [("model.embed_tokens.weight", (arch.vocab, h), 1), ("model.norm.weight", (h,), 1),
            ("lm_head.weight", (arch.vocab, h), 1)]
    return out


def _estimate_absent(arch: Arch, out: Weights, rules: tuple[Rule, ...]) -> None:
    """Estimate, at bf16, the parts the checkpoint holds nothing of (per rank, through the same table)."""
    for name, shape, count in model_tensors(arch, out.mtp_loaded):
        part, style = classify(rules, name)
        if part in out.present:
            continue
        layer = layer_of(name)
        if layer is not None and layer >= arch.layers:
            part = PART_MTP
        out.styles.setdefault(part, set()).add(style)
        nbytes = BF16
        for n in shape:
            nbytes *= n
        for rw in out.ranks:
            rw.absent[part] = rw.absent.get(part, 0) + count * slice_bytes(name, shape, nbytes, style, out.tp)


def styles_shown(weights: Weights) -> dict[str, str]:
    """part -> "column, row" etc., for the report."""
    order = (RANK_SLICED, EXPERT, COLUMN, ROW, VOCAB, REPLICATED)
    return {part: ", ".join(s for s in order if s in styles) for part, styles in weights.styles.items()}


def to_json(rw: RankWeights) -> dict[str, Any]:
    return {"parts": {k: v for k, v in rw.parts.items() if v},
            "tiers": [{"k": k, "experts": t.experts, "bytes": t.bytes}
                      for k, t in sorted(rw.tiers.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))],
            "absent": dict(rw.absent)}


__all__ = ["Inventory", "RankWeights", "Tier", "Weights", "model_tensors", "rank_weights", "scan", "scan_columns",
           "styles_shown"]
