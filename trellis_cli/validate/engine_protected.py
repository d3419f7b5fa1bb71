"""Protected tensors (dense EXL3 tensors of a rank-sliced checkpoint, `protected_tensor_policy`) as each fork
loader version reads them. docs/engines.md cites the functions; docs/findings.md lists the codes.

- shared-H: reads the policy, hydrates tensor_storage (config.json's embedded one when it is a non-empty
  object, else quantization_config.json's) and checks it (`_validate_storage_metadata`,
  `_validate_protected_tensor_storage`: the record's MCG marker, bits_per_weight and trellis shape against
  the declared bits; those checks are format rules of the TR3 dialect). It never compares the stored tensors'
  K with the declaration: `_validate_loaded_tensors` takes any trellis width of 1..8 x 16.
- #190 and R7: the policy is not read, and the rank-sliced path returns before hydrating tensor_storage. Only
  a tensor_storage embedded in config.json's quantization_config (`Exl3Config.from_config`) makes a protected
  linear EXL3 (`get_quant_method`); without a record its trellis/suh/svh/mcg have no parameter to load into.
  With one, `Exl3LinearMethod.process_weights_after_loading` checks its codebook marker against
  `codebook_for_prefix`: inside moe_layers "mcg"; outside, #190 expects no marker at all and R7 the one its
  record lists.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

from trellis_cli.checkpoint.declared import layer_range
from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.findings import Location
from trellis_cli.validate.engine_rules import Refusal, rank_sliced_contract, storage_refusals

POLICY_AT = Location(file="config.json", tensor="hybrid_tr3_tail.protected_tensor_policy")
_LAYER = re.compile(r"layers\.(\d+)\b")  # codebook_for_prefix's layer lookup


def _policy_prefixes(h: dict) -> list[str]:
    policy = h.get("protected_tensor_policy")
    tensors = policy.get("tensors") if isinstance(policy, dict) else None
    return sorted(p for p in tensors if isinstance(p, str) and p) if isinstance(tensors, dict) else []


def _embedded_storage(ckpt: Checkpoint) -> dict:
    q = ckpt.config.get("quantization_config")
    storage = q.get("tensor_storage") if isinstance(q, dict) else None
    return storage if isinstance(storage, dict) else {}


def _storage_entry(storage: dict, prefix: str) -> Any:
    """The record `_storage_entry` finds for a module: its name, without or with a leading `model.`."""
    bare = prefix.removeprefix("model.")
    for candidate in (prefix, bare, f"model.{bare}"):
        if candidate in storage:
            return storage[candidate]
    return None


def _record_codebook(entry: dict) -> str | None:
    stored = entry.get("stored_tensors")
    suffixes = {str(name).rsplit(".", 1)[-1] for name in stored} if isinstance(stored, dict) else set()
    return "mcg" if "mcg" in suffixes else "mul1" if "mul1" in suffixes else None


def protected_storage(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Shared-H: with a policy, maybe_update_config hydrates tensor_storage and `_validate_storage_metadata`
    refuses an empty map or an incomplete EXL3 record before the protected checks."""
    h = rank_sliced_contract(ckpt)
    if h is not None and "protected_tensor_policy" in h:
        yield from storage_refusals(ckpt)


def protected_190(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """#190 (yatesdr/vllm-opt@1f0baf95): codebook_for_prefix answers from moe_layers alone on a rank-sliced
    checkpoint, so a marked protected tensor outside moe_layers is an unexpected codebook."""
    return _protected(ckpt, record_codebook=False)


def protected_r7(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """R7: codebook_for_prefix falls back to the record's marker outside moe_layers."""
    return _protected(ckpt, record_codebook=True)


def _protected(ckpt: Checkpoint, record_codebook: bool) -> Iterator[Refusal]:
    h = rank_sliced_contract(ckpt)
    if h is None or "protected_tensor_policy" not in h:
        return
    storage = _embedded_storage(ckpt)
    prefixes = _policy_prefixes(h)
    unread = [p for p in prefixes if not _is_exl3(_storage_entry(storage, p))]
    if unread or not prefixes:
        yield Refusal("engine.protected-unread", "protected tensors not read", POLICY_AT,
                      "this version reads no protected_tensor_policy, and tensor_storage only from config.json's "
                      "quantization_config (its rank-sliced path never hydrates quantization_config.json): "
                      f"{len(unread) or 'the'} protected module(s) without an EXL3 record there "
                      f"({', '.join(unread[:3])}) get no EXL3 parameters, so their trellis/suh/svh/mcg have nowhere "
                      "to load", expected="an EXL3 record per protected module in config.json's tensor_storage",
                      found=f"{len(unread)} of {len(prefixes)} without")
        return
    moe = layer_range(h.get("moe_layers"))
    for prefix in prefixes:
        entry = _storage_entry(storage, prefix)
        m = _LAYER.search(prefix)
        if m is not None and int(m.group(1)) in moe:
            expected: str | None = "mcg"
        else:
            expected = _record_codebook(entry) if record_codebook else None
        has = [marker for marker in ("mcg", "mul1") if f"{prefix}.{marker}" in ckpt.tensors]
        wrong = len(has) == 2 or (expected is None and has) or (expected is not None and expected not in has)
        if wrong:
            where = ckpt.tensors.get(f"{prefix}.trellis")
            yield Refusal("engine.protected-codebook", f"{prefix}: codebook marker {has or 'none'}, loader expects "
                          f"{expected or 'none'}", Location(file=where.file if where else None, tensor=prefix),
                          "Exl3LinearMethod.process_weights_after_loading compares the loaded markers with "
                          "codebook_for_prefix ('Missing or inconsistent EXL3 tensors ... unexpected codebook' / "
                          f"'mcg'): {_why(expected, record_codebook)}",
                          expected=expected or "no marker", found=has or "no marker")


def _is_exl3(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.get("quant_format") == "exl3"


def _why(expected: str | None, record_codebook: bool) -> str:
    if expected == "mcg":
        return "inside moe_layers every EXL3 module of a rank-sliced checkpoint is MCG"
    if record_codebook:
        return "outside moe_layers the codebook is the one the module's tensor_storage record lists"
    return "on a rank-sliced checkpoint this version expects no codebook marker outside moe_layers"
