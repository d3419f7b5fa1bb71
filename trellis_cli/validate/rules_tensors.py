"""Tensor rules, from header facts only: per (layer, expert, projection, rank) the EXL3 linear is complete
and well-formed, its K (always from the trellis shape) agrees across ranks and projections and with what the
metadata declares, vectors have the right lengths, markers the right dtype and kind, and each layer has the
experts, ranks, shared-H rows, tier sizes and tensor count its dialect requires. How many bitrates a layer
may hold is a loader's rule (engines.py), not the format's: R7 layers hold three.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Generator, Iterator

from trellis_cli.checkpoint import layer_columns
from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, LinearRef, MoeLayer
from trellis_cli.checkpoint.names import H_SIDE
from trellis_cli.codebooks import MARKERS
from trellis_cli.codebooks import NAMES as CODEBOOK_NAMES
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import MAX_MISSING_SHOWN, Finding, Location, error, error_summary, missing_ids, warning

MAX_TIER_EXPERTS = 256  # local expert ids are 8 bits in the mixed kernel
HADAMARD_TILES = 8  # 128-wide Hadamard blocks = 8 tiles of 16
MAX_TEMPLATES = 64  # pairings tried per projection by the proof of a clean layer; beyond it the walk decides


@dataclass(frozen=True)
class LayerContext:
    layer: int
    experts: int | None
    tp: int
    hidden: int | None
    intermediate_rank: int | None
    codebook: str | None
    tr3: bool
    shared: bool
    r7_shared: bool = False  # R7 v2: H-side vectors live in `experts.r7_shared.*`, not per expert
    k_declared_by: str = "the declared K map"  # what declares per-projection K, as messages name it
    k_map_note: str | None = None  # ShardLayout.k_map_note: why the declared K does not bind every loader


def check_layers(ckpt: Checkpoint, layers: list[int]) -> Iterator[Finding]:
    for li in layers:
        layer = ckpt.layers.get(li)
        if layer is not None:
            yield from check_layer(ckpt, layer)


def _context(ckpt: Checkpoint, layer: MoeLayer) -> LayerContext:
    """The layer's geometry, with how its dialect stores it (`Dialect.shard_layout`: the dialect's own answer)."""
    layout = dialect_of(ckpt).shard_layout(ckpt, layer)
    return LayerContext(layer.index, ckpt.num_experts, ckpt.tp, ckpt.hidden, ckpt.intermediate_per_rank,
                        ckpt.codebook, layout.rank_sliced, layout.shared_h, layout.r7_shared, layout.k_declared_by,
                        layout.k_map_note)


def check_layer(ckpt: Checkpoint, layer: MoeLayer, bulk: bool = True) -> Iterator[Finding]:
    """Every rule of one layer. `bulk`: prove a clean layer's linears in C (`_linears_clean`); False walks them one
    by one whatever they hold (the tests compare the two on damaged checkpoints)."""
    ctx = _context(ckpt, layer)
    here = Location(layer=layer.index)
    if not layer.experts:
        yield error("layer.empty", here, "the layer is declared but has no routed-expert tensors")
        return
    if ctx.tr3 and not layer.rank_sliced:
        yield error("tensor.schema", here, "expert tensor names carry no .rank{r}. segment", expected="rank-sliced "
                    "names (tensor_schema)", found="unsliced names")
    for ref in layer.unparsed:
        yield error("tensor.unparsed", Location(file=ref.file, tensor=ref.name), "name under mlp.experts follows no "
                    "known schema")
    yield from _check_membership(ctx, layer)
    ranks = range(ctx.tp) if (ctx.tr3 or layer.rank_sliced) else range(1)
    cols = layer_columns.columns(layer)
    shown = missing = 0  # rank slices: the first MAX_MISSING_SHOWN of the layer, then one total
    if bulk and _linears_clean(ctx, cols, ranks):  # the walk would find nothing but what the K rule says
        if not _expert_ks_agree(ctx, layer, cols):
            for expert, projs in layer.experts.items():
                yield from _check_expert_k(ckpt, ctx, layer, expert, projs, cols)
    else:
        shown, missing = yield from _walk_linears(ckpt, ctx, layer, ranks, cols)
    if ctx.k_map_note is not None:
        yield from _unbinding_k_map(ctx, layer)
    if missing > shown:
        yield error_summary("rank.missing", here, missing - shown, "missing rank slices in this layer",
                            expected=f"ranks 0-{ctx.tp - 1}", found=f"{missing} missing")
    if ctx.shared or layer.shared_h:
        yield from _check_shared_h(ctx, layer)
    yield from _check_tiers(ctx, layer)
    if ctx.tr3:
        yield from _check_tensor_count(ctx, layer)


def _walk_linears(ckpt: Checkpoint, ctx: LayerContext, layer: MoeLayer, ranks: range,
                  cols: layer_columns.LayerColumns) -> Generator[Finding, None, tuple[int, int]]:
    """Every linear of the layer, one by one: what check_layer runs where `_linears_clean` cannot prove it clean.
    Returns (rank slices listed, rank slices missing)."""
    shown = missing = 0
    clean: dict[tuple, bool] = {}  # linear template -> check_linear finds nothing in it (see _template)
    for expert, projs in layer.experts.items():
        for proj in PROJECTIONS:
            if proj not in projs:
                yield error("projection.missing", Location(layer=layer.index, expert=expert, projection=proj),
                            "projection has no tensors")
        for proj, by_rank in projs.items():
            first, total = missing_ids(ranks, by_rank, MAX_MISSING_SHOWN - shown)
            for rank in first:
                yield error("rank.missing", Location(layer=layer.index, expert=expert, projection=proj, rank=rank),
                            "rank slice is missing", expected=f"ranks 0-{ctx.tp - 1}", found=sorted(by_rank))
            shown, missing = shown + len(first), missing + total
            for rank, lin in by_rank.items():
                if rank not in ranks:
                    yield error("rank.extra", Location(layer=layer.index, expert=expert, projection=proj, rank=rank),
                                "rank outside the declared tp", expected=f"< {ctx.tp}", found=rank)
                template = _template(proj, lin)
                passed = clean.get(template)
                if passed is None:  # the first linear of its template: its findings decide for the others
                    found = list(check_linear(ctx, expert, proj, rank, lin))
                    clean[template] = not found and template[1] is not None
                    yield from found
                elif not passed:
                    yield from check_linear(ctx, expert, proj, rank, lin)
        yield from _check_expert_k(ckpt, ctx, layer, expert, projs, cols)
    return shown, missing


def _linears_clean(ctx: LayerContext, cols: layer_columns.LayerColumns, ranks: range) -> bool:
    """True when `_walk_linears` would yield nothing but the K rule's findings: every expert has the three
    projections and each exactly `ranks`, no linear has an extra field, and `check_linear` finds nothing in any
    pairing of the (dtype, shape) each field takes within a projection (`layer_columns.kinds`: a superset of the
    linears' own templates, as `_template` reads them). False sends the layer to the walk, which names what is
    wrong."""
    layout = cols.layout()
    if layout is None or set(layout[0]) != set(PROJECTIONS) or set(layout[1]) != set(ranks) \
            or any(cols.field(layer_columns.EXTRA)):
        return False
    for proj in PROJECTIONS:
        options = [cols.field_kinds(i, proj) for i in layer_columns.TENSOR_FIELDS]
        tried = [o for o in options if o is not None]
        if len(tried) < len(options) or math.prod(map(len, tried)) > MAX_TEMPLATES:
            return False
        for trellis, suh, svh, su, sv, mcg, mul1 in itertools.product(*tried):
            stand_in = LinearRef(trellis, suh, svh, su, sv, mcg, mul1)
            if next(check_linear(ctx, 0, proj, 0, stand_in), None) is not None:
                return False
    return True


def _expert_ks_agree(ctx: LayerContext, layer: MoeLayer, cols: layer_columns.LayerColumns) -> bool:
    """True when `_check_expert_k` finds nothing in any expert of a rank-sliced layer: each expert's linears hold
    one K, and it is the declared one wherever the declaration binds."""
    if not ctx.tr3 or not cols.every_expert_one_k():
        return False
    declared = layer.declared_k
    if ctx.k_map_note is not None or declared is None:
        return True
    ks = cols.expert_ks()
    return all(declared[e] == next(iter(ks[e])) for e in layer.experts if e < len(declared))


def _check_membership(ctx: LayerContext, layer: MoeLayer) -> Iterator[Finding]:
    if ctx.experts is None:
        return
    first, total = missing_ids(range(ctx.experts), layer.experts)
    for expert in first:
        yield error("expert.missing", Location(layer=layer.index, expert=expert), "expert has no tensors",
                    expected=f"experts 0-{ctx.experts - 1}", found=f"{len(layer.experts)} experts")
    if total > len(first):
        yield error_summary("expert.missing", Location(layer=layer.index), total - len(first), "missing experts "
                            "in this layer", expected=f"experts 0-{ctx.experts - 1}", found=f"{total} missing")
    for expert in layer.experts:
        if expert >= ctx.experts:
            yield error("expert.extra", Location(layer=layer.index, expert=expert), "expert id outside the declared "
                        "expert count", expected=f"< {ctx.experts}", found=expert)


def check_linear(ctx: LayerContext, expert: int, proj: str, rank: int, lin: LinearRef) -> Iterator[Finding]:
    def at(tensor: str | None = None) -> Location:
        return Location(layer=ctx.layer, expert=expert, projection=proj, rank=rank, tensor=tensor)

    t = lin.trellis
    if t is None:
        yield error("tensor.missing", at(lin.prefix + ".trellis"), "the linear has no trellis tensor")
    else:
        yield from _check_trellis(ctx, proj, t, at)
    in_f, out_f = lin.in_features, lin.out_features
    for vec, legacy, length, code in ((lin.suh, lin.su, in_f, "tensor.suh-length"),
                                      (lin.svh, lin.sv, out_f, "tensor.svh-length")):
        name = "suh" if code == "tensor.suh-length" else "svh"
        if ctx.r7_shared and H_SIDE[proj] == name and vec is None and legacy is None:
            continue
        if ctx.shared and H_SIDE[proj] == name:
            for ref in (vec, legacy):
                if ref is not None:
                    yield error("shared-h.leftover", at(ref.name), "per-expert hidden-side vector left in a "
                                "shared_h_v1 checkpoint (the shared row replaces it)")
            continue
        if vec is None and legacy is None:
            yield error("tensor.missing", at(f"{lin.prefix}.{name}"), f"the linear has no {name} (nor legacy "
                        f"{name[:2]}) tensor")
            continue
        if vec is not None:
            if vec.dtype != "F16":
                yield error("tensor.dtype", at(vec.name), f"{name} must be fp16", expected="F16", found=vec.dtype)
            if length is not None and vec.shape not in ((length,), (1, length)):
                yield error(code, at(vec.name), f"{name} length must match the trellis", expected=[length],
                            found=list(vec.shape))
        if legacy is not None:
            if vec is not None:
                yield warning("tensor.both-sign-forms", at(legacy.name), f"both {name} and legacy {name[:2]} present "
                              f"({name} wins)")
            elif legacy.dtype != "I16" or (length is not None and legacy.shape != (length // 16,)):
                yield error("tensor.dtype", at(legacy.name), f"legacy {name[:2]} must be int16 [n/16]",
                            expected=f"I16 {[length // 16] if length else '[n/16]'}",
                            found=f"{legacy.dtype} {list(legacy.shape)}")
    yield from _check_markers(ctx, lin, at)
    for ref in lin.extra:
        field = ref.name.rsplit(".", 1)[-1]
        if field == "bias":
            yield error("tensor.bias", at(ref.name), "routed experts with a bias are not served by the MoE kernels")
        elif field == "scale":
            yield warning("tensor.scale-ignored", at(ref.name), "no loader applies it: exllamav3 no longer reads "
                          ".scale and the rank-sliced vLLM loader has no scale parameter for experts, so a scale "
                          "folded out of the weights here is lost and outputs are off by it")
        else:
            yield warning("tensor.unexpected", at(ref.name), f"unexpected field {field!r} (ignored by loaders)")


def _template(proj: str, lin: LinearRef) -> tuple:
    """What `check_linear` decides from, besides the layer's context: the projection, and the dtype and shape of
    each field present (names only label its findings). Every linear of a layer's experts shares a few templates,
    so a template found clean once is clean for all (one tuple per linear instead of every rule); a linear with
    extra fields gets None in its second place and is always checked."""
    if lin.extra:
        return (proj, None)
    t, suh, svh, su, sv, mcg, mul1 = lin[:7]
    return (proj, t and (t.dtype, t.shape), suh and (suh.dtype, suh.shape), svh and (svh.dtype, svh.shape),
            su and (su.dtype, su.shape), sv and (sv.dtype, sv.shape), mcg and (mcg.dtype, mcg.shape),
            mul1 and (mul1.dtype, mul1.shape))


def _check_trellis(ctx: LayerContext, proj: str, t, at) -> Iterator[Finding]:
    if t.dtype != "I16":
        yield error("tensor.dtype", at(t.name), "trellis must be int16", expected="I16", found=t.dtype)
    if len(t.shape) != 3:
        yield error("tensor.shape", at(t.name), "trellis must be [in/16, out/16, 16K]", expected="3 dims",
                    found=list(t.shape))
        return
    last = t.shape[2]
    if last % 16 or not 1 <= last // 16 <= 8:
        yield error("tensor.k-range", at(t.name), "last dim must be 16*K with K in 1..8", expected="16..128 step 16",
                    found=last)
    if t.shape[0] % HADAMARD_TILES or t.shape[1] % HADAMARD_TILES:
        yield error("tensor.align128", at(t.name), "in and out features must be multiples of 128 (Hadamard block)",
                    found=[16 * t.shape[0], 16 * t.shape[1]])
    if ctx.hidden and ctx.intermediate_rank:
        h, i = ctx.hidden // 16, ctx.intermediate_rank // 16
        expected = (h, i) if proj != "down_proj" else (i, h)
        if tuple(t.shape[:2]) != expected:
            yield error("tensor.geometry", at(t.name), "trellis tiles do not match hidden / intermediate per rank",
                        expected=list(expected), found=list(t.shape[:2]))


def _check_markers(ctx: LayerContext, lin: LinearRef, at) -> Iterator[Finding]:
    if lin.mcg is not None and lin.mul1 is not None:
        yield error("marker.both", at(lin.prefix), "both .mcg and .mul1 markers (loaders disagree on which wins)")
    for ref in (lin.mcg, lin.mul1):
        if ref is not None and (ref.dtype != "I32" or ref.shape != ()):
            yield error("marker.dtype", at(ref.name), "codebook marker must be a 0-dim int32",
                        expected="I32 []", found=f"{ref.dtype} {list(ref.shape)}")
    declared = ctx.codebook
    if declared in CODEBOOK_NAMES and not (lin.mcg is not None and lin.mul1 is not None):
        if lin.codebook != declared:
            code = "marker.missing" if lin.codebook == "3inst" else "marker.codebook"
            yield error(code, at(lin.prefix), "codebook marker does not match the declared codebook",
                        expected=declared, found=lin.codebook)


def _check_expert_k(ckpt: Checkpoint, ctx: LayerContext, layer: MoeLayer, expert: int, projs,
                    cols: layer_columns.LayerColumns) -> Iterator[Finding]:
    if ctx.tr3:
        ks = {k for k in cols.expert_ks()[expert] if k is not None}
        if len(ks) > 1:
            yield error("expert.k-inconsistent", Location(layer=layer.index, expert=expert), "projections or ranks "
                        "of one expert have different K (one K per expert in this dialect)", found=sorted(ks))
            return
        declared = layer.declared_k
        if ctx.k_map_note is None and declared is not None and ks and expert < len(declared) \
                and declared[expert] != next(iter(ks)):
            yield error("tensor.k-mismatch", Location(layer=layer.index, expert=expert), "the bitmap's K differs "
                        "from the K of the trellis shapes", expected=declared[expert], found=next(iter(ks)))
        return
    for proj, by_rank in projs.items():
        ks = {lin.k for lin in by_rank.values() if lin.k is not None}
        where = Location(layer=layer.index, expert=expert, projection=proj)
        if len(ks) > 1:
            yield error("expert.k-inconsistent", where, "ranks of one projection have different K", found=sorted(ks))
        elif ks and layer.declared_projection_k is not None and ctx.k_map_note is None:
            declared_k = layer.declared_projection_k.get((expert, proj))
            if declared_k is not None and declared_k != next(iter(ks)):
                yield error("tensor.k-mismatch", where,
                            f"{ctx.k_declared_by} K differs from the K of the trellis shape",
                            expected=declared_k, found=next(iter(ks)))


def _unbinding_k_map(ctx: LayerContext, layer: MoeLayer) -> Iterator[Finding]:
    """A declared K no loader of this layer is bound by, against the trellis shapes: one warning per layer."""
    differ = []
    for expert, projs in sorted(layer.experts.items()):
        for proj, by_rank in projs.items():
            ks = {lin.k for lin in by_rank.values() if lin.k is not None}
            if len(ks) != 1:
                continue  # none, or ranks that disagree (expert.k-inconsistent)
            if layer.declared_projection_k is not None:
                declared = layer.declared_projection_k.get((expert, proj))
            else:
                declared = layer.declared_k[expert] if layer.declared_k and expert < len(layer.declared_k) else None
            if declared is not None and declared != next(iter(ks)):
                differ.append((expert, proj, declared, next(iter(ks))))
    if differ:
        expert, proj, declared, stored = differ[0]
        yield warning("tensor.k-mismatch", Location(layer=layer.index, expert=expert, projection=proj),
                      f"{ctx.k_declared_by} K differs from the K of the trellis shapes for {len(differ)} "
                      f"(expert, projection) pair(s) of this layer; {ctx.k_map_note}",
                      expected=declared, found=stored)


def _check_shared_h(ctx: LayerContext, layer: MoeLayer) -> Iterator[Finding]:
    if not ctx.shared:
        for (proj, rank), fields in layer.shared_h.items():
            for ref in fields.values():
                yield error("shared-h.unexpected", Location(layer=layer.index, tensor=ref.name), "shared_h row in a "
                            "checkpoint whose rotation_layout is not shared_h_v1")
        return
    for proj in PROJECTIONS:
        present = {rank for (p, rank), fields in layer.shared_h.items() if p == proj and H_SIDE[proj] in fields}
        first, total = missing_ids(range(ctx.tp), present)
        for rank in first:
            yield error("shared-h.missing", Location(layer=layer.index, projection=proj, rank=rank),
                        f"no shared {H_SIDE[proj]} row for this projection and rank")
        if total > len(first):
            yield error_summary("shared-h.missing", Location(layer=layer.index, projection=proj), total - len(first),
                                f"ranks without a shared {H_SIDE[proj]} row")
        for rank in sorted(r for r in present if r < ctx.tp):
            ref = layer.shared_h[(proj, rank)][H_SIDE[proj]]
            if ref.dtype != "F16" or (ctx.hidden and ref.shape not in ((ctx.hidden,), (1, ctx.hidden))):
                yield error("shared-h.shape", Location(layer=layer.index, tensor=ref.name), "shared row must be fp16 "
                            "[H] or [1, H]", expected=f"F16 [{ctx.hidden}]", found=f"{ref.dtype} {list(ref.shape)}")
    for (proj, rank), fields in layer.shared_h.items():
        for field, ref in fields.items():
            if field != H_SIDE[proj] or rank >= ctx.tp:
                yield error("shared-h.unexpected", Location(layer=layer.index, tensor=ref.name), "unexpected shared_h "
                            "key", expected=f"{proj}.rank<{ctx.tp}.{H_SIDE[proj]}", found=f"rank{rank}.{field}")


def _check_tiers(ctx: LayerContext, layer: MoeLayer) -> Iterator[Finding]:
    tiers = layer_columns.columns(layer).partition()
    for k, ids in tiers.items():
        if len(ids) > MAX_TIER_EXPERTS:
            yield error("tier.too-large", Location(layer=layer.index), f"tier K{k} holds more experts than local ids "
                        "can address", expected=f"<= {MAX_TIER_EXPERTS}", found=len(ids))


def expected_tensor_count(ctx: LayerContext) -> int | None:
    """Per layer: E*3*tp*(3 + marker), with the H-side vectors moved to 3*tp shared rows under shared_h_v1."""
    if ctx.experts is None:
        return None
    per_linear = 3 + (1 if ctx.codebook is not None and MARKERS.get(ctx.codebook) is not None else 0)
    linears = ctx.experts * 3 * ctx.tp
    if ctx.shared:
        return linears * (per_linear - 1) + 3 * ctx.tp
    return linears * per_linear


def _check_tensor_count(ctx: LayerContext, layer: MoeLayer) -> Iterator[Finding]:
    expected = expected_tensor_count(ctx)
    found = layer_tensor_count(layer)
    if expected is not None and found != expected:
        yield error("layer.tensor-count", Location(layer=layer.index), "expert tensor count differs from what the "
                    "dialect requires", expected=expected, found=found)


def layer_tensor_count(layer: MoeLayer) -> int:
    cols = layer_columns.columns(layer)  # the seven fields of each linear, less those absent, plus extras
    n = sum(map(cols.present, layer_columns.TENSOR_FIELDS)) + sum(map(len, cols.field(layer_columns.EXTRA)))
    return n + sum(len(f) for f in layer.shared_h.values()) + len(layer.r7_shared) + len(layer.unparsed)
