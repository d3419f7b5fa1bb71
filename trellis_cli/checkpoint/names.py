"""Tensor-name grammar for routed experts: one parser for every dialect.

A routed-expert tensor name is `model.layers.{L}.mlp.experts.{E}.{proj}[.rank{r}].{field}`; shared rows use
`experts.shared_h.{proj}.rank{r}.{suh|svh}` (shared_h_v1) and `experts.r7_shared.{name}` (R7 v2). Names are
matched against this grammar, never guessed from file names. `w1`/`w3`/`w2` templates map to gate/up/down.
Ids are canonical decimal only (id_ranges.CANONICAL_ID): loaders build the names they look up with `str(id)`,
so `experts.007`, Arabic-Indic or full-width digits, another prefix, or a name that Unicode normalization
turns into a schema name are not those tensors; `noncanonical_reason` says why such a name is not one.
"""

from __future__ import annotations

import re
import unicodedata
from typing import NamedTuple

from trellis_cli.header import text_escape
from trellis_cli.id_ranges import CANONICAL_ID, parse_id

# The EXL3 per-linear fields (docs/exl3-format.md §1); anything else under a linear is kept as "extra".
LINEAR_FIELDS = frozenset({"trellis", "suh", "svh", "su", "sv", "mcg", "mul1"})
PROJECTION_ALIASES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
                      "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

# The prefix every loader's schema puts before `layers.` (GLM and DeepSeek checkpoints, TR3's tensor_schema).
NAME_PREFIX = "model."
_ID = f"({CANONICAL_ID})"
_EXPERTS = re.compile(rf"^model\.layers\.{_ID}\.mlp\.experts\.(.+)$")
# The same prefix as a key in a raw safetensors header (a quoted JSON string): the layer id of each routed-expert
# entry, found without decoding the header (a key written with JSON escapes is not matched: count it as other).
_LINEAR = re.compile(rf"^{_ID}\.(gate_proj|up_proj|down_proj|w1|w2|w3)(?:\.rank{_ID})?\.([A-Za-z0-9_]+)$")
_SHARED_H = re.compile(rf"^shared_h\.(gate_proj|up_proj|down_proj)\.rank{_ID}\.([A-Za-z0-9_]+)$")
_R7_SHARED = re.compile(rf"^r7_shared\.(?:rank{_ID}\.)?([A-Za-z0-9_]+)$")

# The common case in one match (a production checkpoint has ~935k expert tensor names).
LINEAR_NAME = re.compile(
    rf"^model\.layers\.{_ID}\.mlp\.experts\.{_ID}\.(gate_proj|up_proj|down_proj|w1|w2|w3)(?:\.rank{_ID})?"
    r"\.([A-Za-z0-9_]+)$")
# The same less its field: a linear's name prefix (`model.layers.L.mlp.experts.E.proj[.rankR]`), matched whole.
LINEAR_PREFIX = re.compile(LINEAR_NAME.pattern.removeprefix("^").removesuffix(r"\.([A-Za-z0-9_]+)$"))
# What a routed-expert name looks like to a reader: any prefix, any script's digits (\w is Unicode here).
_LOOKS_LIKE_EXPERT = re.compile(r"^(.*?)layers\.(\w+)\.mlp\.experts\.(.*)$", re.DOTALL)

KIND_LINEAR = "linear"
KIND_SHARED_H = "shared_h"
KIND_R7_SHARED = "r7_shared"
KIND_UNPARSED = "unparsed"


class ExpertName(NamedTuple):
    kind: str  # linear | shared_h | r7_shared | unparsed
    layer: int
    expert: int | None = None
    projection: str | None = None
    rank: int | None = None  # None: no `.rank{r}.` segment
    field: str | None = None


def is_expert_name(name: str) -> bool:
    """Whether `parse_expert_name(name)` is not None, in one match (a repack asks it of ~935k names)."""
    return _EXPERTS.match(name) is not None


def parse_expert_name(name: str) -> ExpertName | None:
    """Classify a tensor name; None when it is not under `model.layers.{L}.mlp.experts.` (canonical ids)."""
    m = _EXPERTS.match(name)
    if m is None:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    lin = _LINEAR.match(rest)
    if lin is not None:
        rank = None if lin.group(3) is None else int(lin.group(3))
        return ExpertName(KIND_LINEAR, layer, int(lin.group(1)), PROJECTION_ALIASES[lin.group(2)], rank,
                          lin.group(4))
    sh = _SHARED_H.match(rest)
    if sh is not None:
        return ExpertName(KIND_SHARED_H, layer, None, sh.group(1), int(sh.group(2)), sh.group(3))
    r7 = _R7_SHARED.match(rest)
    if r7 is not None:
        rank = None if r7.group(1) is None else int(r7.group(1))
        return ExpertName(KIND_R7_SHARED, layer, None, None, rank, r7.group(2))
    return ExpertName(KIND_UNPARSED, layer)


def noncanonical_reason(name: str) -> str | None:
    """Why `name`, which reads as a routed-expert tensor, is not the one its schema spelling names; None when
    it does not read as one or is spelled canonically (parse_expert_name then classifies it)."""
    normal = unicodedata.normalize("NFKC", name)
    m = _LOOKS_LIKE_EXPERT.match(normal)
    if m is None:
        return None
    if normal != name:
        return f"Unicode normalization (NFKC) turns it into {text_escape(normal)!r}: not the same name"
    prefix, layer, rest = m.groups()
    if prefix != NAME_PREFIX:
        return f"its prefix {text_escape(prefix)!r} is not {NAME_PREFIX!r}"
    parts = rest.split(".")
    ids = [("layer", layer)]
    if parts[0].isdecimal():  # Unicode digits too: exactly what must not pass for an id
        ids.append(("expert", parts[0]))
    ids += [("rank", part[4:]) for part in parts[1:-1] if part.startswith("rank") and part[4:].isdecimal()]
    for what, text in ids:
        if parse_id(text) is None:
            return f"its {what} id {text_escape(repr(text))} is not canonical decimal{_spelled(text)}"
    return None


def _spelled(text: str) -> str:
    try:
        return f" (a loader spells id {int(text)} as {str(int(text))!r})"
    except ValueError:
        return ""


# Hidden-side vectors: under shared_h_v1 these live in one shared row per (layer, projection, rank).
H_SIDE = {"gate_proj": "suh", "up_proj": "suh", "down_proj": "svh"}
I_SIDE = {"gate_proj": "svh", "up_proj": "svh", "down_proj": "suh"}
PROJECTIONS_BY_INDEX = ("gate_proj", "up_proj", "down_proj")

# The rank-sliced TR3 contract (docs/checkpoint-dialects.md, "TR3 rank-sliced"): the exact schema strings
# config.json must declare, and the key and shard names they describe. Written by synth and `repack --to tr3`,
# checked by validate.
TENSOR_SCHEMA = "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
SHARED_H_TENSOR_SCHEMA = "model.layers.{L}.mlp.experts.shared_h.{proj}.rank{r}.{suh|svh}"


def expert_key(layer: int, expert: int, proj: str, rank: int, field_name: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.rank{rank}.{field_name}"


def shared_h_key(layer: int, proj: str, rank: int) -> str:
    """The one shared hidden-side row of (layer, projection, rank) under shared_h_v1."""
    return f"model.layers.{layer}.mlp.experts.shared_h.{proj}.rank{rank}.{H_SIDE[proj]}"


def shard_name(layer: int) -> str:
    """The TR3 shard of one MoE layer (tools resolve tensors through the index, not this name)."""
    return f"model-layer-{layer:03d}.safetensors"
