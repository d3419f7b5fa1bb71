"""TR3's own metadata rules: the `hybrid_tr3_tail` contract (the fail-closed rules 1-11 of the vLLM loader),
the declared bitmaps against it and the model's counts, the protected-tensor policy (rule 12), and the MoE
layers the files hold outside `moe_layers`. Run by the TR3 dialect's `check`, beside validate's shared shard
rules; the loader profiles read `bits_map_problems` for their own verdicts.
"""

from __future__ import annotations

from typing import Any, Iterator

from trellis_cli.checkpoint.declared import bits_map_overrides, layer_range, layer_span, uniform_bits
from trellis_cli.dialects.tr3.declared import contract_of
from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.names import SHARED_H_TENSOR_SCHEMA, TENSOR_SCHEMA
from trellis_cli.dialects.interface import QUANT_CONFIG
from trellis_cli.findings import MAX_MISSING_SHOWN, Finding, Location, error, error_summary, warning
from trellis_cli.header import coerced_int, is_int

REQUIRED_TR3_KEYS = ("bits", "codebook", "experts_per_layer", "moe_layers", "tensor_schema", "tp")
MIXED_K_RANGE = range(3, 7)
UNIFORM_K_VALUES = {3, 4, 5, 6, 8}
PROTECTED_FORMAT = "exl3-protected-v1"
PROTECTED_BITS = (6, 8)
LOADER_UNIFORM_K = (3, 4, 5, 6, 8)  # the union of what the rank-sliced loader versions serve uniformly


def _where(key: str) -> Location:
    return Location(file="config.json", tensor=f"hybrid_tr3_tail.{key}")


def check_hybrid_contract(ckpt: Checkpoint) -> Iterator[Finding]:
    """Every rule of the declared hybrid_tr3_tail (none when the config holds none: detection said TR3 for it)."""
    hybrid = contract_of(ckpt)
    if hybrid is None:
        return
    yield from _check_tr3_contract(hybrid, ckpt.count_limit)
    yield from _check_counts(ckpt, hybrid)
    yield from check_bitmaps(ckpt, hybrid)
    if "protected_tensor_policy" in hybrid:
        yield from _check_protected_policy(ckpt, hybrid["protected_tensor_policy"])
    yield from check_undeclared_layers(ckpt, hybrid)


def _check_tr3_contract(h: dict, limit: int) -> Iterator[Finding]:
    for key in REQUIRED_TR3_KEYS:
        if key == "bits" and key not in h and isinstance(h.get("trellis_bits_by_layer"), dict):
            yield warning("config.tr3-key-missing", _where(key), "bits is missing: the shared-H loader reads "
                          "trellis_bits_by_layer instead, the #190 and R7 versions require bits (engine.bits-required)")
        elif key not in h:
            yield error("config.tr3-key-missing", _where(key), "required hybrid_tr3_tail key is missing")
    if "codebook" in h and h["codebook"] != "mcg":
        yield error("config.tr3-codebook", _where("codebook"), "rank-sliced checkpoints must use the mcg codebook",
                    expected="mcg", found=h["codebook"])
    if "moe_layers" in h and not layer_span(h["moe_layers"]):
        yield error("config.tr3-moe-layers", _where("moe_layers"), "must be [first, last] integers with "
                    "0 <= first <= last", found=h["moe_layers"])
    elif "moe_layers" in h and not all(is_int(v) for v in h["moe_layers"]):
        yield _int_spelling("moe_layers", h["moe_layers"])
    if "tensor_schema" in h and h["tensor_schema"] != TENSOR_SCHEMA:
        yield error("config.tr3-tensor-schema", _where("tensor_schema"), "tensor_schema is not the canonical string",
                    expected=TENSOR_SCHEMA, found=h["tensor_schema"])
    shared = h.get("rotation_layout", "per_expert_v1") == "shared_h_v1"
    if shared and h.get("shared_h_tensor_schema") != SHARED_H_TENSOR_SCHEMA:
        yield error("config.tr3-shared-h-schema", _where("shared_h_tensor_schema"), "shared_h_v1 needs the "
                    "canonical shared_h_tensor_schema", expected=SHARED_H_TENSOR_SCHEMA,
                    found=h.get("shared_h_tensor_schema"))
    if not shared and "shared_h_tensor_schema" in h:
        yield error("config.tr3-shared-h-schema", _where("shared_h_tensor_schema"), "shared_h_tensor_schema is only "
                    "allowed with rotation_layout shared_h_v1", found=h.get("rotation_layout", "per_expert_v1"))
    for key in ("experts_per_layer", "tp"):
        n = coerced_int(h[key]) if key in h else None
        if key in h and not (n is not None and n > 0):
            yield error("config.tr3-positive-int", _where(key), "must be a positive integer", found=h[key])
        elif key in h and not is_int(h[key]):
            yield _int_spelling(key, h[key])
    bits = h.get("bits")
    if isinstance(bits, str) and bits.lower().startswith("mixed"):
        yield from _check_mixed(h, bits)
    elif "bits" in h:
        yield from _check_uniform(h, bits, limit)


def _check_mixed(h: dict, bits: str) -> Iterator[Finding]:
    yield from _check_bits_spelling(bits)
    k_values = h.get("k_values")
    coerced = [coerced_int(k) for k in k_values] if isinstance(k_values, list) else []
    if not coerced or not all(k is not None and k in MIXED_K_RANGE for k in coerced):
        yield error("config.tr3-k-values", _where("k_values"), "mixed bits need a non-empty k_values list within "
                    "3..6", found=k_values)
    elif not all(is_int(k) for k in k_values or []):
        yield _int_spelling("k_values", k_values)
    if not isinstance(h.get("bits_per_expert"), str):
        yield error("config.tr3-bits-per-expert", _where("bits_per_expert"), "mixed bits need a 'file.json:field' "
                    "string", found=h.get("bits_per_expert"))
    if "trellis_bits_by_layer" in h:
        yield warning("config.tr3-mixed", _where("trellis_bits_by_layer"), "trellis_bits_by_layer with bits "
                      "'mixed': the shared-H loader refuses it (engine.bits-map), the #190 one ignores the map")


def _check_uniform(h: dict, bits: Any, limit: int) -> Iterator[Finding]:
    if uniform_bits(bits) is None:
        yield error("config.tr3-bits", _where("bits"), "bits must be an integral K or 'mixed'", found=bits)
    elif isinstance(bits, str):
        yield _int_spelling("bits", bits)
    yield from _check_uniform_k(h, bits)
    by_layer = h.get("trellis_bits_by_layer")
    if by_layer is None:
        return
    overrides = bits_map_overrides(h)
    if overrides:
        yield warning("config.tr3-bits-by-layer", _where("trellis_bits_by_layer"), f"says another K than bits "
                      f"({bits!r}) for {len(overrides)} layer(s): the #190 and R7 loaders read bits for every layer "
                      "and never the map, the shared-H loader reads the map and not bits; each profile checks the "
                      "stored K against its own field (engine.uniform-k, engine.bits-map-k)",
                      expected=uniform_bits(bits), found={str(li): k for li, k in sorted(overrides.items())[:8]})
    for problem, expected, found in bits_map_problems(h, limit):  # the shared-H loader's: engine.bits-map
        yield warning("config.tr3-bits-by-layer", _where("trellis_bits_by_layer"), f"{problem} (the shared-H loader "
                      "refuses it; the #190 one does not read trellis_bits_by_layer)", expected=expected, found=found)


def bits_map_problems(h: dict, limit: int | None = None) -> Iterator[tuple[str, Any, Any]]:
    """What is wrong with a uniform checkpoint's trellis_bits_by_layer, for the loader version that reads it."""
    by_layer = h.get("trellis_bits_by_layer")
    if by_layer is None:
        return
    if not isinstance(by_layer, dict):
        yield "must be an object", "object", type(by_layer).__name__
        return
    wanted = {str(layer) for layer in layer_range(h.get("moe_layers"), limit)}
    if wanted and set(by_layer) != wanted:
        yield "keys must cover moe_layers exactly", f"{len(wanted)} layers", sorted(set(by_layer) ^ wanted)[:8]
    bad = {key: k for key, k in by_layer.items() if not (is_int(k) and k in UNIFORM_K_VALUES)}
    if bad:
        yield "K must be one of 3, 4, 5, 6, 8", "3, 4, 5, 6 or 8", dict(list(bad.items())[:8])


def _int_spelling(key: str, value: Any) -> Finding:
    """A count or bitrate spelled as a string or a float: the #190-era loaders read it with int() and load; the
    shared-H version refuses it (engine_stamps.json_ints)."""
    return warning("config.int-spelling", _where(key), "not a JSON integer: the #190 and R7 loader versions "
                   "coerce it with int(), the shared-H version refuses it", expected="a JSON integer", found=value)


def _check_counts(ckpt: Checkpoint, h: dict) -> Iterator[Finding]:
    declared = h.get("experts_per_layer")
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        model = ckpt.config.get(key)
        if is_int(model) and is_int(declared) and model != declared:
            yield error("config.expert-count", _where("experts_per_layer"), f"differs from config.json {key}",
                        expected=model, found=declared)


def check_bitmaps(ckpt: Checkpoint, h: dict) -> Iterator[Finding]:
    """Rule 10-11: per layer a list of experts_per_layer values, each a declared bitrate, each bitrate used."""
    experts = h.get("experts_per_layer")
    k_values = h.get("k_values") if isinstance(h.get("k_values"), list) else None
    sources = ckpt.k_source
    for li, layer in ckpt.layers.items():
        ks = layer.declared_k
        if ks is None:
            continue
        where = Location(file=sources.get(li, "config.json").split(":")[0], layer=li)
        if is_int(experts) and len(ks) != experts:
            yield error("bitmap.length", where, "bitmap lists a different number of experts than experts_per_layer",
                        expected=experts, found=len(ks))
        declared = None if k_values is None else {coerced_int(k) for k in k_values}
        bad = sorted({repr(k) for k in ks if not (coerced_int(k) is not None
                                                  and (declared is None or coerced_int(k) in declared))})
        if bad:
            yield error("bitmap.k-value", where, "bitmap values outside the declared k_values", expected=k_values,
                        found=bad[:8])
        elif not all(is_int(k) for k in ks):
            yield warning("config.int-spelling", where, "bitmap values are not JSON integers: the loaders read "
                          "them with int(), so they load, but other tools may not",
                          found=sorted({repr(k) for k in ks if not is_int(k)})[:8])


def _check_protected_policy(ckpt: Checkpoint, policy: Any) -> Iterator[Finding]:
    """vLLM rule 12: dense tensors kept at 6 or 8 bits (mcg) must be declared exactly and stored as declared."""
    where = _where("protected_tensor_policy")
    if not isinstance(policy, dict) or set(policy) != {"format", "tensors"}:
        yield error("config.protected-policy", where, "must be an object with exactly the keys format and tensors",
                    expected=["format", "tensors"], found=sorted(policy) if isinstance(policy, dict) else policy)
        return
    if policy["format"] != PROTECTED_FORMAT:
        yield error("config.protected-policy", where, "unknown policy format", expected=PROTECTED_FORMAT,
                    found=policy["format"])
    tensors = policy["tensors"]
    if not isinstance(tensors, dict) or not tensors:
        yield error("config.protected-policy", where, "tensors must be a non-empty object", found=tensors)
        return
    for prefix, entry in tensors.items():
        yield from _check_protected_entry(ckpt, prefix, entry)
    storage = _protected_storage(ckpt)
    if isinstance(storage, dict):
        stored = {key for key, rec in storage.items() if isinstance(rec, dict) and rec.get("quant_format") == "exl3"}
        if stored != set(tensors):
            yield error("config.protected-policy", Location(file=QUANT_CONFIG, tensor="tensor_storage"),
                        "the EXL3 modules of tensor_storage must be exactly the protected set",
                        expected=len(tensors), found=f"{len(stored)} ({len(stored ^ set(tensors))} differ)")


def _protected_storage(ckpt: Checkpoint) -> Any:
    """The tensor_storage the shared-H loader checks protected tensors against: config.json's embedded one when
    it is a non-empty object, else quantization_config.json's (its _hydrate_tensor_storage)."""
    embedded = ckpt.config.get("quantization_config")
    storage = embedded.get("tensor_storage") if isinstance(embedded, dict) else None
    if isinstance(storage, dict) and storage:
        return storage
    return (ckpt.quant_config or {}).get("tensor_storage")


def _check_protected_entry(ckpt: Checkpoint, prefix: str, entry: Any) -> Iterator[Finding]:
    where = Location(file="config.json", tensor=f"hybrid_tr3_tail.protected_tensor_policy.tensors.{prefix}")
    if not isinstance(entry, dict) or set(entry) != {"bits", "codebook"}:
        yield error("config.protected-policy", where, "each entry has exactly the keys bits and codebook",
                    found=sorted(entry) if isinstance(entry, dict) else entry)
        return
    bits = entry["bits"]
    if not (is_int(bits) and bits in PROTECTED_BITS) or entry["codebook"] != "mcg":
        yield error("config.protected-policy", where, "protected tensors are bits 6 or 8 with codebook mcg",
                    expected={"bits": "6|8", "codebook": "mcg"}, found=entry)
        return
    trellis = ckpt.tensors.get(f"{prefix}.trellis")
    if trellis is None:
        yield error("config.protected-missing", where, "declared protected tensor has no .trellis in the checkpoint",
                    found=f"{prefix}.trellis")
        return
    tensor_where = Location(file=trellis.file, tensor=trellis.name)
    width = trellis.shape[-1] if len(trellis.shape) == 3 else None
    if width is None or width % 16 or not 1 <= width // 16 <= 8:
        yield error("config.protected-k", tensor_where, "a protected trellis is rank 3 with a last dim of 16 x K, "
                    "K in 1..8 (the loader's _validate_loaded_tensors refuses any other)", expected=16 * bits,
                    found=list(trellis.shape))
    elif width != 16 * bits:
        # The shared-H loader checks the declaration against tensor_storage only and loads any width 1..8 x 16.
        yield warning("config.protected-stored-k", tensor_where, f"the stored trellis is K{width // 16} where the "
                      f"policy declares {bits}: the shared-H loader compares the declaration with tensor_storage's "
                      "record only (_validate_protected_tensor_storage) and loads any trellis width "
                      f"(_validate_loaded_tensors), so it serves this tensor at K{width // 16}",
                      expected=16 * bits, found=width)
    if f"{prefix}.mcg" not in ckpt.tensors or f"{prefix}.mul1" in ckpt.tensors:
        yield error("config.protected-marker", tensor_where, "protected tensors carry an .mcg marker and no .mul1",
                    expected=".mcg only", found=[m for m in (".mcg", ".mul1") if f"{prefix}{m}" in ckpt.tensors])
    yield from _check_protected_record(ckpt, prefix, bits)


def _check_protected_record(ckpt: Checkpoint, prefix: str, bits: int) -> Iterator[Finding]:
    """The shared-H loader's _validate_protected_tensor_storage, on the module's tensor_storage record (the
    coverage of the records is checked beside): its stored_tensors name an .mcg marker and no .mul1
    ("missing its MCG marker"), bits_per_weight is the declared bits as a JSON integer, and the recorded
    trellis shape ends in 16 x bits."""
    record = (_protected_storage(ckpt) or {}).get(prefix)
    if not isinstance(record, dict):
        return
    where = Location(file=_protected_storage_file(ckpt), tensor=f"tensor_storage.{prefix}")
    stored = record.get("stored_tensors")
    names = stored if isinstance(stored, dict) else {}
    if f"{prefix}.mcg" not in names or f"{prefix}.mul1" in names:
        yield error("config.protected-marker", where, "the record's stored_tensors must list the .mcg marker and "
                    "no .mul1: the shared-H loader (_validate_protected_tensor_storage) refuses a protected tensor "
                    "whose record is missing its MCG marker or has a MUL1 one", expected=f"{prefix}.mcg",
                    found=sorted(str(n) for n in names if str(n).rsplit(".", 1)[-1] in ("mcg", "mul1")))
    stored_bits = record.get("bits_per_weight")
    if not is_int(stored_bits) or stored_bits != bits:
        yield error("config.protected-k", where, "tensor_storage bits_per_weight must be the declared bits as a "
                    "JSON integer", expected=bits, found=stored_bits)
    entry = names.get(f"{prefix}.trellis")
    shape = entry.get("shape") if isinstance(entry, dict) else None
    if not (isinstance(shape, list) and shape and is_int(shape[-1]) and shape[-1] == 16 * bits):
        yield error("config.protected-k", where, "the record's trellis shape must end in 16 x the declared bits "
                    "(the shared-H loader reads the shape from the record, not from the shard)",
                    expected=16 * bits, found=shape)


def _protected_storage_file(ckpt: Checkpoint) -> str:
    embedded = ckpt.config.get("quantization_config")
    storage = embedded.get("tensor_storage") if isinstance(embedded, dict) else None
    return "config.json" if isinstance(storage, dict) and storage else QUANT_CONFIG


def _check_bits_spelling(bits: str) -> Iterator[Finding]:
    """A mixed spelling other than 'mixed' (any case, surrounding spaces) fails every loader version read: the
    older one turns it into a number, the newer one compares it exactly (engines.py: bits_exact)."""
    if bits.strip().lower() != "mixed":
        yield error("config.tr3-bits", _where("bits"), "bits must be an integral K or the string 'mixed' (the "
                    "rank-sliced loaders refuse other spellings)", expected="mixed", found=bits)


def _check_uniform_k(h: dict, bits: Any) -> Iterator[Finding]:
    """Without a per-layer map, uniform bits is every layer's K, and no loader version serves K7 or K2."""
    if "trellis_bits_by_layer" in h or not (is_int(bits) or (isinstance(bits, float) and bits.is_integer())):
        return
    if int(bits) not in LOADER_UNIFORM_K:
        yield error("config.tr3-bits", _where("bits"), "no rank-sliced loader serves this uniform K (and there is "
                    "no trellis_bits_by_layer)", expected="3, 4, 5, 6 or 8", found=bits)


def check_undeclared_layers(ckpt: Checkpoint, h: dict) -> Iterator[Finding]:
    """Layers whose expert tensors are in the files but outside `moe_layers`: the loader never loads them."""
    if not layer_span(h.get("moe_layers")):
        return  # config.tr3-moe-layers
    declared = layer_range(h["moe_layers"])  # "3" and 3.0 as int() reads them, as the #190 and R7 loaders do
    first, last = declared.start, declared.stop - 1
    outside = [li for li, layer in ckpt.layers.items() if not first <= li <= last and (layer.experts or
                                                                                       layer.shared_h)]
    for li in outside[:MAX_MISSING_SHOWN]:
        yield error("layer.undeclared", Location(layer=li), "expert tensors of a layer outside moe_layers (the "
                    "loader never loads them)", expected=f"layers {first}-{last}", found=li)
    if len(outside) > MAX_MISSING_SHOWN:
        yield error_summary("layer.undeclared", Location(), len(outside) - MAX_MISSING_SHOWN, "layers outside moe_layers",
                            expected=f"layers {first}-{last}", found=f"{len(outside)} layers")
