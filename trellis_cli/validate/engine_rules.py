"""The checks behind the loader profiles of engines.py: each looks at the parsed checkpoint and yields what one
loader version refuses, as a Refusal (a stable code, a short reason for the compatibility line, where, why).

Only behaviour that differs between loaders, or that a loader adds to the format rules, lives here; what every
profiled reader of a dialect refuses stays a plain rule (rules_config / rules_tensors). docs/engines.md says
where each check comes from.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

from trellis_cli.checkpoint.declared import bits_map_overrides, layer_range, uniform_bits
from trellis_cli.checkpoint import layer_columns
from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint
from trellis_cli.dialects.interface import QUANT_CONFIG
from trellis_cli.dialects.interface import B12X, B12X_130, EXLLAMAV3, VLLM, ContainerRefusal
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.checkpoint.names import H_SIDE
from trellis_cli.findings import Location
from trellis_cli.header import is_int

ONE_GRID_TIERS = 2  # the mixed path takes exactly two bitrates per layer, with no serial fallback
UNIFORM_K_190 = range(3, 7)
UNIFORM_K_SHARED_H = (3, 4, 5, 6, 8)
MIXED_K_RANGE = range(3, 7)
LEGACY_FIELDS = (layer_columns.SU, layer_columns.SV)


class Refusal(NamedTuple):
    code: str
    reason: str  # a few words for the compatibility line
    where: Location
    message: str
    expected: Any = None
    found: Any = None


def rank_sliced_contract(ckpt: Checkpoint) -> dict | None:
    """The rank-sliced contract the fork's exl3-trellis path reads; None: the checkpoint declares none."""
    return dialect_of(ckpt).rank_sliced_contract(ckpt)


def _hybrid(ckpt: Checkpoint) -> dict:
    return rank_sliced_contract(ckpt) or {}


def _at(key: str) -> Location:
    return Location(file="config.json", tensor=f"hybrid_tr3_tail.{key}")


def _container(ckpt: Checkpoint, refusal: ContainerRefusal) -> Refusal:
    return Refusal("engine.container", refusal.reason, Location(), refusal.message, expected=refusal.expected,
                   found=refusal.found if refusal.found is not None else ckpt.dialect)


# ---- containers: which dialects a loader reads at all (each dialect says why a loader refuses it) -------

def container_refusal(ckpt: Checkpoint, family: str) -> Iterator[Refusal]:
    """The dialect's named refusal when loader `family` does not read its container."""
    refusal = dialect_of(ckpt).container_refusal(family)
    if refusal is not None:
        yield _container(ckpt, refusal)


def vllm_container(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """The fork detects hybrid_tr3_tail (format exl3-trellis) and reads tensor_storage; nothing else."""
    refusal = dialect_of(ckpt).container_refusal(VLLM)
    if refusal is not None:
        yield _container(ckpt, refusal)


def b12x_container(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """b12x's exl3-v1 reader opens exl3-manifest.json and the layer files it names, and nothing else; a
    container it reads may still declare what b12x 1.5.x refuses (Dialect.loader_refusal)."""
    yield from _family(ckpt, B12X)


def _family(ckpt: Checkpoint, family: str) -> Iterator[Refusal]:
    dialect = dialect_of(ckpt)
    refusal = dialect.container_refusal(family)
    if refusal is not None:
        yield _container(ckpt, refusal)
        return
    refusal = dialect.loader_refusal(ckpt, family)
    if refusal is not None:
        yield Refusal(refusal.code, refusal.reason, refusal.where or Location(), refusal.message,
                      expected=refusal.expected, found=refusal.found)


def b12x130_container(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """b12x 1.3.0 reads BTX (btx-manifest.json) and sqg-era b12x_trellis blocks; each dialect says why not."""
    yield from _family(ckpt, B12X_130)


def exllamav3_container(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """exllamav3 looks up `experts.{E}.{proj}.{trellis|suh|svh|su|sv}` per linear, with no rank segment."""
    dialect = dialect_of(ckpt)
    refusal = dialect.container_refusal(EXLLAMAV3)
    if refusal is not None:
        yield _container(ckpt, refusal)
    elif any(ckpt.layers[li].rank_sliced for li in layers if li in ckpt.layers):
        yield Refusal("engine.container", "rank-sliced names", Location(), "expert tensors carry a .rank{r}. "
                      "segment: exllamav3 finds no experts.{E}.{proj}.trellis and loads no expert",
                      expected="experts.{E}.{proj}.trellis", found="experts.{E}.{proj}.rank{r}.trellis")
    elif dialect.streamed_k_maps and any(ckpt.layers[li].r7_shared for li in layers if li in ckpt.layers):
        yield Refusal("engine.container", "layer-shared vectors", Location(), "hidden-side vectors live once per "
                      "layer (experts.r7_shared): exllamav3 needs suh/svh (or su/sv) under every linear")


# ---- bits / k_values spelling: where the two fork versions differ -----------------------------------------

def bits_exact(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H version: only the exact string 'mixed' selects the mixed path; 'Mixed' goes the uniform way."""
    bits = _hybrid(ckpt).get("bits")
    if isinstance(bits, str) and bits != "mixed" and bits.strip().lower() == "mixed":
        yield Refusal("engine.bits", "bits not exactly 'mixed'", _at("bits"), "only the exact string 'mixed' selects "
                      "the mixed path; this spelling is read as uniform and then has no per-layer bit map",
                      expected="mixed", found=bits)


def k_values_two(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H version: a mixed checkpoint declares exactly two distinct k_values."""
    h = _hybrid(ckpt)
    k_values = h.get("k_values")
    if h.get("bits") != "mixed" or not isinstance(k_values, list):
        return
    if all(is_int(k) and k in MIXED_K_RANGE for k in k_values) and k_values and len(set(k_values)) != ONE_GRID_TIERS:
        yield Refusal("engine.k-values", "k_values not exactly two", _at("k_values"), "this version requires exactly "
                      "two distinct k_values for bits 'mixed'", expected="2 values", found=k_values)


def every_k_used(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H version: every layer of moe_layers uses every declared bitrate (an all-K3 MTP layer fails)."""
    h = _hybrid(ckpt)
    k_values = h.get("k_values")
    if h.get("bits") != "mixed" or not isinstance(k_values, list) or not all(is_int(k) for k in k_values):
        return
    wanted = set(k_values)
    for li in layers:
        ks = ckpt.layers[li].declared_k if li in ckpt.layers else None
        if ks and all(is_int(k) for k in ks) and set(ks) != wanted and set(ks) <= wanted:
            yield Refusal("engine.unused-k", "a layer leaves a declared K unused", Location(layer=li),
                          "this version requires every layer to use every declared bitrate",
                          expected=sorted(wanted), found=sorted(set(ks)))


def bitmap_field(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H version: the referenced field must be there; the tail_tr3-only MTP entry is not taken as all-K3."""
    sources = ckpt.k_source
    for li in layers:
        source = sources.get(li, "")
        if source.endswith(":tail_tr3"):
            yield Refusal("engine.bitmap-field", "bitmap entry without the K field",
                          Location(file=source.split(":")[0], layer=li), "the layer's entry has only a tail_tr3 "
                          "list: this version reads the referenced field and refuses the layer",
                          expected=_hybrid(ckpt).get("bits_per_expert"), found="tail_tr3 only")


def uniform_map(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H version: a uniform checkpoint needs trellis_bits_by_layer, or the legacy pair it is derived from."""
    h = _hybrid(ckpt)
    bits = h.get("bits")
    if rank_sliced_contract(ckpt) is None or isinstance(bits, str) or "trellis_bits_by_layer" in h:
        return
    integral = isinstance(bits, (int, float)) and not isinstance(bits, bool) and float(bits).is_integer()
    derivable = (integral and bool(layer_range(h.get("moe_layers"))) and h.get("nvfp4_keep_per_layer") == 0
                 and h.get("tr3_tail_per_layer") == h.get("experts_per_layer"))
    if not derivable:
        yield Refusal("engine.bits-map", "no per-layer bit map", _at("trellis_bits_by_layer"), "a uniform checkpoint "
                      "needs trellis_bits_by_layer, or tr3_tail_per_layer == experts_per_layer with "
                      "nvfp4_keep_per_layer == 0 to derive it from bits; this version refuses without either",
                      expected="trellis_bits_by_layer", found={k: h.get(k) for k in ("tr3_tail_per_layer",
                                                                                     "nvfp4_keep_per_layer")})


def uniform_k_190(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """#190 version: uniform bits (read for every layer; trellis_bits_by_layer is unknown to it) in 3..6."""
    h = _hybrid(ckpt)
    bits = uniform_bits(h.get("bits"))  # float(), as this version reads it: "4" is K4
    if rank_sliced_contract(ckpt) is None or bits is None:
        return  # a non-integral bits: config.tr3-bits reports it for every version
    if bits not in UNIFORM_K_190:
        yield Refusal("engine.uniform-k", f"uniform K{int(bits)} unsupported", _at("bits"), "this version serves "
                      "uniform rank-sliced layers at K3..K6 only", expected="3..6", found=bits)
    # trellis_bits_by_layer is never read here: where it contradicts bits, the layer's slabs are K{bits}, and
    # the stored K must be that (the format rules compare the shapes with the map only where the two agree).
    for li in sorted(bits_map_overrides(h)):
        stored = _stored_ks(ckpt, li)
        if stored and stored != [int(bits)]:
            yield Refusal("engine.uniform-k", f"layer {li} stored at K{stored}, bits says K{int(bits)}",
                          Location(layer=li), "this version reads bits for every layer (trellis_bits_by_layer is "
                          f"not read) and allocates K{int(bits)} slabs; the stored trellis shapes are another K",
                          expected=int(bits), found=stored)


def bits_map_k(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H version: a uniform checkpoint's K per layer is trellis_bits_by_layer's (bits is not read when the
    map is there); where the map contradicts bits the format rules leave the shapes to each profile."""
    h = rank_sliced_contract(ckpt)
    for li, k in sorted(bits_map_overrides(h).items()):
        stored = _stored_ks(ckpt, li)
        if stored and stored != [k]:
            yield Refusal("engine.bits-map-k", f"layer {li} stored at K{stored}, trellis_bits_by_layer says {k!r}",
                          Location(layer=li), "this version takes the layer's K from trellis_bits_by_layer "
                          "(_configure_rank_sliced; trellis_bitrates_for_layer) and allocates slabs of that K; "
                          "the stored trellis shapes are another K", expected=k, found=stored)


def _stored_ks(ckpt: Checkpoint, li: int) -> list[int]:
    layer = ckpt.layers.get(li)
    if layer is None:
        return []
    return sorted(k for k in frozenset().union(*layer_columns.columns(layer).expert_ks().values()) if k is not None)


def shared_h_unsupported(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """#190 version: no rotation_layout; every expert needs its own hidden-side suh/svh."""
    if dialect_of(ckpt).shared_h or any(ckpt.layers[li].shared_h for li in layers if li in ckpt.layers):
        yield Refusal("engine.shared-h", "shared_h_v1 unsupported", _at("rotation_layout"), "this version has no "
                      "rotation_layout: it loads per-expert hidden-side suh/svh, which a shared_h_v1 checkpoint "
                      "does not have", expected="per_expert_v1", found=ckpt.rotation_layout)


# ---- per-layer facts -------------------------------------------------------------------------------------

def tier_count(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Both fork versions: a mixed rank-sliced layer runs on the one-grid path, which takes exactly two bitrates."""
    if rank_sliced_contract(ckpt) is None:
        return
    for li in layers:
        tiers = layer_columns.columns(ckpt.layers[li]).partition() if li in ckpt.layers else {}
        if len(tiers) > ONE_GRID_TIERS:
            yield Refusal("engine.tier-count", f"{len(tiers)} bitrates in one layer", Location(layer=li),
                          "the one-grid mixed path takes exactly two bitrates per layer and has no serial fallback",
                          expected=f"{ONE_GRID_TIERS} bitrates", found=sorted(tiers))


def legacy_signs(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Both fork versions: MoE experts get suh/svh parameters only; packed su/sv is a dense-layer form."""
    dialect = dialect_of(ckpt)
    if not (dialect.rank_sliced_contract(ckpt) is not None or dialect.module_records):
        return
    shared = dialect.shared_h
    for li in layers:
        first, count = None, 0
        if li in ckpt.layers and not any(map(layer_columns.columns(ckpt.layers[li]).present, LEGACY_FIELDS)):
            continue  # no su/sv in the layer (counted in C)
        for projs in ckpt.layers[li].experts.values() if li in ckpt.layers else ():
            for proj, by_rank in projs.items():
                for lin in by_rank.values():
                    for legacy, vec, side in ((lin.su, lin.suh, "suh"), (lin.sv, lin.svh, "svh")):
                        if legacy is not None and vec is None and not (shared and H_SIDE[proj] == side):
                            first, count = first or legacy, count + 1
        if first is not None:
            yield Refusal("engine.legacy-signs", "legacy su/sv on routed experts",
                          Location(file=first.file, layer=li, tensor=first.name), "routed experts load only suh/svh: "
                          f"{count} legacy packed su/sv vector(s) here stand in for them, so the loader finds suh/svh "
                          "missing", expected="suh/svh", found=f"{count} su/sv")


def one_k_per_projection(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """exllamav3: a layer's experts are fused per projection, which needs one K and one codebook across them."""
    for li in layers:
        layer = ckpt.layers.get(li)
        if layer is None:
            continue
        for proj in PROJECTIONS:
            lins = [lin for projs in layer.experts.values() for lin in projs.get(proj, {}).values()]
            ks = sorted({lin.k for lin in lins if lin.k is not None})
            books = sorted({lin.codebook for lin in lins})
            if len(ks) > 1 or len(books) > 1:
                yield Refusal("engine.k-per-projection", "per-expert K in one projection",
                              Location(layer=li, projection=proj), "exllamav3 fuses a layer's experts per "
                              "projection and asserts one K and one codebook across them",
                              expected="one K, one codebook", found={"K": ks, "codebook": books})


def module_records(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Both fork versions, non-rank-sliced EXL3: per-module records in tensor_storage, checked before loading."""
    if dialect_of(ckpt).module_records:
        yield from storage_refusals(ckpt)


def storage_refusals(ckpt: Checkpoint) -> Iterator[Refusal]:
    """tensor_storage (embedded, else quantization_config.json): non-empty, records complete (every path that
    reads it: plain EXL3 in all fork versions, R7 in the R7 version)."""
    embedded = ckpt.config.get("quantization_config")
    storage = embedded.get("tensor_storage") if isinstance(embedded, dict) else None
    where = Location(file="config.json" if storage else QUANT_CONFIG, tensor="tensor_storage")
    storage = storage or (ckpt.quant_config or {}).get("tensor_storage")
    if not isinstance(storage, dict) or not storage:
        yield Refusal("engine.tensor-storage", "no tensor_storage", where, "the generic EXL3 path needs a non-empty "
                      "tensor_storage map", expected="object", found=type(storage).__name__)
        return
    records = {k: r for k, r in storage.items() if isinstance(r, dict) and r.get("quant_format") == "exl3"}
    bad = [k for k, r in records.items() if not _stored_ok(r.get("stored_tensors"))]
    if not records or bad:
        yield Refusal("engine.tensor-storage", "tensor_storage records incomplete", where, "each EXL3 record's "
                      "stored_tensors must name trellis, suh or su, svh or sv, and not both mcg and mul1",
                      expected="stored_tensors per record", found=f"{len(bad)} of {len(records)} records: {bad[:3]}")


def _stored_ok(stored: Any) -> bool:
    if not isinstance(stored, dict):
        return False
    fields = {str(name).rsplit(".", 1)[-1] for name in stored}
    return "trellis" in fields and bool(fields & {"suh", "su"}) and bool(fields & {"svh", "sv"}) and not (
        {"mcg", "mul1"} <= fields)
