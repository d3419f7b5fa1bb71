"""The model weights every engine profile checks: a loader builds the whole model, not only its routed experts.

Each profile's model class (checkpoint/architecture.py: vLLM's DeepseekV2ForCausalLM, which serves GLM MoE DSA in
the fork, in the mainline manifest path over b12x's reader, and behind b12x's exl3-v1 experts) allocates every
attention, indexer, norm, router, shared-expert, dense-MLP, embedding and lm_head weight. vLLM's loader checks
that each was loaded only for an unquantized model; with `quant_method` exl3 a missing weight stays uninitialized
memory and the server answers garbage. So a missing weight, or one of the wrong shape or dtype, is a refusal
(`engine.weights-missing`, `engine.weights-shape`), named compactly: one refusal per engine for every missing
weight, grouped by module with its layer ranges. The MTP layers are loaded only by the MTP draft model; what they
lack is a warning (`weights.mtp-missing`). An architecture this table does not list is said once
(`weights.unchecked`), never passed silently as checked.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Mapping

from trellis_cli.checkpoint.architecture import ConfigProblem, ModelWeights, Weight, expected_form, mismatch, model_weights
from trellis_cli.checkpoint import layer_columns
from trellis_cli.checkpoint.model import Checkpoint, TensorRef
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import Finding, Location, Severity, warning
from trellis_cli.id_ranges import compact_ranges
from trellis_cli.validate.engine_rules import Refusal

MISSING, SHAPE, CONFIG = "engine.weights-missing", "engine.weights-shape", "engine.weights-config"
MAX_SHAPE_REFUSALS = 10  # then one refusal with the count
MAX_GROUPS_SHOWN = 40  # module kinds named (an architecture has about 30, whatever its depth); then a count
_LAYER = re.compile(r"^model\.layers\.([0-9]+)\.")
_SYNTH_NOTE = ("this checkpoint was written by `trellis synth` without --non-expert: it holds the routed experts "
               "only, so no engine loads it; `trellis synth OUT --non-expert bf16` writes every weight")



class Stored(Mapping[str, tuple[str, tuple[int, ...]]]):
    """name -> (dtype, shape) of every tensor the checkpoint's files hold, read from the model's own records
    (a production checkpoint has ~935k: a copy of each cost a second and 100 MB), then from the headers of the
    files outside the model, which win for a name in both (as a dict updated file by file would)."""

    def __init__(self, tensors: Mapping[str, TensorRef]) -> None:
        self._tensors = tensors
        self.outside: dict[str, tuple[str, tuple[int, ...]]] = {}

    def __getitem__(self, name: str) -> tuple[str, tuple[int, ...]]:
        found = self.outside.get(name)
        if found is not None:
            return found
        ref = self._tensors[name]
        return ref.dtype, tuple(ref.shape)

    def __iter__(self) -> Iterator[str]:
        yield from self._tensors
        yield from (name for name in self.outside if name not in self._tensors)

    def __len__(self) -> int:
        return len(self._tensors) + sum(name not in self._tensors for name in self.outside)


# (checkpoint, its stored tensors, its model weights), read once for the six profiles that ask within one
# validation (`shared()`) and kept no longer: a module-level memo held the last checkpoint validated (~400 MB at
# production size) until the next validation or the interpreter's exit.
_MEMO: ContextVar[list | None] = ContextVar("engine_weights", default=None)


@contextmanager
def shared() -> Iterator[None]:
    """Within this block the facts of a checkpoint are read once (it is read, not changed, meanwhile)."""
    token = _MEMO.set([None, None, None])
    try:
        yield
    finally:
        _MEMO.reset(token)


def _facts(ckpt: Checkpoint) -> tuple[Stored, ModelWeights | None | ConfigProblem]:
    memo = _MEMO.get()
    if memo is not None and memo[0] is ckpt:
        return memo[1], memo[2]
    try:
        expected: ModelWeights | None | ConfigProblem = model_weights(ckpt.config)
    except ConfigProblem as problem:
        expected = problem
    stored = _stored(ckpt) if expected is not None else Stored({})
    if memo is not None:
        memo[:] = [ckpt, stored, expected]
    return stored, expected


def _stored(ckpt: Checkpoint) -> Stored:
    """name -> (dtype, shape) of every tensor the checkpoint's files hold. A container keeps its model weights in
    safetensors files beside its layer files, outside its model: each is read through the one reader."""
    from trellis_cli.checkpoint import reader
    from trellis_cli.checkpoint.tensor_map import holds_first
    from trellis_cli.errors import CheckFailed

    stored = Stored(ckpt.tensors)
    for name, size in sorted(ckpt.files.items()):
        if not name.endswith(".safetensors") or size < 0:
            continue
        header = ckpt.headers.get(name)
        if header is not None and (not header.tensors or holds_first(ckpt.tensors, header.tensors)):
            continue  # its tensors are the model's already
        try:
            header = reader.shard_header(ckpt, name)
        except CheckFailed:
            continue  # the file rules name a file that cannot be read (a link out, a bad header)
        stored.outside.update({t: (e.dtype, tuple(e.shape)) for t, e in header.tensors.items()})
    return stored


def model_weights_rule(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Every weight the model class loads is present with its shape and dtype (a summary of the missing ones):
    a float `.weight`, or an EXL3 linear where the model class may quantize it."""
    return _check(ckpt, any_dtype=False)


def model_weights_mxfp8_rule(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """The mainline manifest path (and b12x's experts under it) loads its dense weights as MXFP8
    (`dense_format`): every weight present with its shape; the dtypes of that format are not listed here."""
    return _check(ckpt, any_dtype=True)


def _check(ckpt: Checkpoint, any_dtype: bool) -> Iterator[Refusal]:
    if not dialect_of(ckpt).holds_model_weights:
        return  # nothing here holds them to check (a b12x_trellis block is its config and rate tensor)
    stored, expected = _facts(ckpt)
    if expected is None:
        return
    if isinstance(expected, ConfigProblem):
        yield Refusal(CONFIG, "config cannot build the model", Location(file="config.json"), str(expected))
        return
    missing, wrong = _compare(expected.main, stored, any_dtype)
    if missing:
        yield Refusal(MISSING, f"{len(missing):,} model weights missing ({_parts(missing, 3)})",
                      Location(tensor=missing[0].name),
                      f"{len(missing):,} of the {len(expected.main):,} weights {expected.model_class} loads besides "
                      f"the routed experts are not in the checkpoint: {describe(missing)}",
                      expected=f"every weight of {expected.model_class}", found=f"{len(missing):,} absent")
    for weight, problem in wrong[:MAX_SHAPE_REFUSALS]:
        yield Refusal(SHAPE, "model weight of the wrong shape or dtype", Location(tensor=weight.name),
                      f"{expected.model_class} loads {weight.name} as {expected_form(weight, any_dtype)}; "
                      f"the checkpoint has {problem}", expected=list(weight.shape), found=problem)
    if len(wrong) > MAX_SHAPE_REFUSALS:
        yield Refusal(SHAPE, "model weights of the wrong shape or dtype", Location(),
                      f"{len(wrong) - MAX_SHAPE_REFUSALS:,} more weights of the wrong shape or dtype: "
                      f"{describe([w for w, _ in wrong[MAX_SHAPE_REFUSALS:]])}")


def _compare(weights: list[Weight], stored: Stored,
             any_dtype: bool = False) -> tuple[list[Weight], list[tuple[Weight, str]]]:
    missing, wrong = [], []
    for weight in weights:
        problem = mismatch(weight, stored, any_dtype)
        if problem == "missing":
            missing.append(weight)
        elif problem is not None:
            wrong.append((weight, problem))
    return missing, wrong


def describe(weights: list[Weight], limit: int = MAX_GROUPS_SHOWN) -> str:
    """`model.layers.{0-77}.self_attn.q_a_proj.weight, ..., lm_head.weight`: one entry per module kind with
    its layer ranges, in first-seen order; a count past `limit` kinds."""
    groups: dict[str, list[int]] = {}
    for weight in weights:
        m = _LAYER.match(weight.name)
        key = weight.name if m is None else "model.layers.{L}." + weight.name[m.end():]
        groups.setdefault(key, [])
        if m is not None:
            groups[key].append(int(m.group(1)))
    shown = [key.replace("{L}", "{" + compact_ranges(ids) + "}") if ids else key
             for key, ids in list(groups.items())[:limit]]
    more = len(groups) - limit
    return ", ".join(shown) + (f" and {more} more kinds" if more > 0 else "")


_PARTS = (("indexer.", "indexer"), ("self_attn.", "attention"), ("embed_tokens", "embeddings"), ("lm_head", "lm_head"),
          ("mlp.gate.", "router"), ("shared_experts.", "shared expert"), ("mlp.", "dense MLP"), ("norm", "norms"))


def _parts(weights: list[Weight], limit: int = len(_PARTS) + 1) -> str:
    """The parts of the model the missing weights belong to, in words: "attention, indexer, router, ..."."""
    seen: list[str] = []
    for weight in weights:
        part = next((word for key, word in _PARTS if key in weight.name), "other")
        if "layernorm" in weight.name or weight.name.endswith("norm" + ".weight"):
            part = "norms"
        if part not in seen:
            seen.append(part)
    return ", ".join(seen[:limit]) + (", ..." if len(seen) > limit else "")


def notes(ckpt: Checkpoint) -> Iterator[Finding]:
    """Said once per validation, whatever the engine: an architecture whose weights are not listed here, and
    the MTP layers' missing weights (only the MTP draft model loads them)."""
    dialect = dialect_of(ckpt)
    if not dialect.holds_model_weights:
        yield Finding("weights.unchecked", Severity.INFO, Location(file="config.json"),
                      f"{dialect.described_as} checkpoint is read here as its declarations alone: the model's weights "
                      "were not checked against a model class", "weights in a container trellis reads",
                      "a declaration block")
        return
    stored, expected = _facts(ckpt)
    if expected is None:
        model_type = ckpt.config.get("model_type") if isinstance(ckpt.config, dict) else None
        if not isinstance(model_type, str):
            return  # no architecture named (a container alone): no model class to check against
        yield Finding("weights.unchecked", Severity.INFO, Location(file="config.json", tensor="model_type"),
                      f"model_type {model_type!r}: trellis lists the model weights of GLM MoE DSA and DeepSeek-V3 "
                      "only, so the weights besides the routed experts were not checked against a model class",
                      "glm_moe_dsa, deepseek_v3 or deepseek_v32", model_type)
        return
    if isinstance(expected, ConfigProblem):
        return
    for layer, weights in expected.mtp.items():
        if not _stores_layer(ckpt, stored, layer):
            continue  # no MTP layer stored at all: a draft model is not asked for
        missing, wrong = _compare(weights, stored)
        if missing or wrong:
            yield warning("weights.mtp-missing", Location(layer=layer),
                          f"MTP layer {layer}: the MTP draft model (speculative decoding) loads it; "
                          f"{len(missing):,} of its {len(weights):,} weights are missing"
                          + (f" ({describe(missing)})" if missing else "")
                          + (f", {len(wrong):,} of the wrong shape or dtype" if wrong else ""))


def _stores_layer(ckpt: Checkpoint, stored: Stored, layer: int) -> bool:
    """Whether any stored name lies under `model.layers.{layer}.`: one of the layer's own expert tensors says so
    at once (the MTP layer of a TR3 checkpoint has them); else every name is looked at."""
    moe = ckpt.layers.get(layer)
    first = layer_columns.columns(moe).linears[:1] if moe is not None else []
    names = [ref.name for ref in first[0][:7] if ref is not None] if first else []
    if names and names[0].startswith(f"model.layers.{layer}.") and names[0] in stored:
        return True
    return next(_layer_names(stored, layer), None) is not None


def _layer_names(stored: Stored, layer: int) -> Iterator[str]:
    prefix = f"model.layers.{layer}."
    return (name for name in stored if name.startswith(prefix))


def synth_note(ckpt: Checkpoint, missing_refused: bool) -> str | None:
    """What the report says of an experts-only checkpoint that `trellis synth` wrote."""
    tail = ckpt.config.get("hybrid_tr3_tail") if isinstance(ckpt.config, dict) else None
    producer = tail.get("producer_version") if isinstance(tail, dict) else None
    return _SYNTH_NOTE if missing_refused and producer == "trellis synth" else None
