"""The normalized checkpoint model every later stage reads (validate, inspect, repack, bench).

Torch-free and lazy: it holds header facts (file, dtype, shape, byte range) and declarations, never
tensor data. `read_tensor` in checkpoint/tensors.py turns a TensorRef into a tensor when one is needed.

Vocabulary follows the format: a MoE layer has experts; an expert has three projections
(gate_proj, up_proj, down_proj); each projection is stored once per tensor-parallel rank as one EXL3
linear (trellis + suh + svh + codebook marker). K = trellis.shape[-1] // 16 always comes from the shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from collections.abc import Iterator, Mapping, MutableMapping, ValuesView
from typing import TYPE_CHECKING, Any, NamedTuple

from trellis_cli.codebooks import MCG_MARKER, MUL1_MARKER  # noqa: F401  (the marker values, re-exported)
from trellis_cli.errors import CheckFailed
from trellis_cli.header_records import TensorEntry

if TYPE_CHECKING:
    from trellis_cli.sources import Source

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

DIALECT_TR3_PER_EXPERT = "tr3/per_expert_v1"
DIALECT_TR3_SHARED_H = "tr3/shared_h_v1"
DIALECT_EXL3 = "exl3"  # plain exllamav3: per-tensor experts, no rank slices
DIALECT_R7 = "r7"  # per-projection K maps (recognized and inspected)
DIALECT_ROUTE_PACK = "trellis-route-pack"  # output of `trellis repack`
DIALECT_EXL3V1 = "exl3-v1"  # b12x's slot-major container (exl3-manifest.json + one file per layer)

class VectorRef(NamedTuple):
    """One hidden- or output-side vector (suh / svh) as the data rules read it, whatever the dialect stores:
    a whole tensor (`row` None) or one row of a per-layer table."""

    at: Any  # findings.Location of the vector
    kind: str  # "suh" or "svh"
    ref: "TensorRef"
    row: int | None = None


# Floor of Checkpoint.count_limit, so a checkpoint whose shards are absent still gets per-item findings.
MIN_COUNT_LIMIT = 4096


# One tensor in one safetensors file, as its header describes it: the header's own entry (header.TensorEntry:
# name, file, dtype, shape, begin, end, data_start), never a copy (a production checkpoint has ~935k).
TensorRef = TensorEntry


class LinearRef(NamedTuple):
    """One EXL3 linear: one projection of one expert on one rank (or a whole tensor when tp=1). A NamedTuple:
    a production checkpoint has ~233k of them, and a frozen dataclass costs several times as much to build."""

    trellis: TensorRef | None
    suh: TensorRef | None = None  # None under shared-H for hidden-side vectors (see MoeLayer.shared_h)
    svh: TensorRef | None = None
    su: TensorRef | None = None  # legacy packed signs
    sv: TensorRef | None = None
    mcg: TensorRef | None = None
    mul1: TensorRef | None = None
    extra: tuple[TensorRef, ...] = ()  # unexpected fields under this prefix (bias, scale, ...)

    @property
    def prefix(self) -> str:
        """The key prefix, e.g. model.layers.3.mlp.experts.17.up_proj.rank1: its first tensor's name (trellis,
        suh, ... in this order, then the extra fields) less the field. Read from the names, not stored: a string
        per linear cost ~21 MB at production size."""
        first = next(filter(None, self[:7]), None) or next(iter(self.extra), None)
        return "" if first is None else first.name.rsplit(".", 1)[0]

    @property
    def k(self) -> int | None:
        """Bits per weight from the trellis shape, None when the shape cannot say."""
        if self.trellis is None or len(self.trellis.shape) != 3 or self.trellis.shape[2] % 16:
            return None
        return self.trellis.shape[2] // 16

    @property
    def in_features(self) -> int | None:
        return None if self.trellis is None or len(self.trellis.shape) != 3 else 16 * self.trellis.shape[0]

    @property
    def out_features(self) -> int | None:
        return None if self.trellis is None or len(self.trellis.shape) != 3 else 16 * self.trellis.shape[1]

    @property
    def codebook(self) -> str:
        """From the markers: neither -> 3inst, .mcg -> mcg, .mul1 -> mul1 (both: validate reports it)."""
        if self.mcg is not None:
            return "mcg"
        if self.mul1 is not None:
            return "mul1"
        return "3inst"


@dataclass
class MoeLayer:
    index: int
    # experts[e][projection][rank] -> LinearRef; rank is 0 for unsliced (plain exllamav3) checkpoints
    experts: dict[int, dict[str, dict[int, LinearRef]]] = field(default_factory=dict)
    # K per expert as declared by metadata (tier_bitmap.json), None if the dialect declares nothing
    declared_k: list[int] | None = None
    # R7: K per (expert, projection) as declared; None otherwise
    declared_projection_k: dict[tuple[int, str], int] | None = None
    # shared-H rows: (projection, rank) -> {"suh"|"svh": TensorRef}
    shared_h: dict[tuple[str, int], dict[str, TensorRef]] = field(default_factory=dict)
    files: set[str] = field(default_factory=set)  # shards holding this layer's expert tensors
    # R7 v2 layer-shared vectors (`experts.r7_shared.<name>`), by name
    r7_shared: dict[str, TensorRef] = field(default_factory=dict)
    # tensors under `mlp.experts.` whose names follow no known schema (validate reports them)
    unparsed: list[TensorRef] = field(default_factory=list)
    # True when expert tensor names carry a `.rank{r}.` segment
    rank_sliced: bool = False

    def expert_k(self, expert: int) -> int | None:
        """The K of an expert when all its projections and ranks agree, else None."""
        k, first = None, True
        for ranks in self.experts.get(expert, {}).values():
            for lin in ranks.values():
                t = lin.trellis  # LinearRef.k inlined: called for every linear of every layer, several times
                shape = None if t is None else t.shape
                lin_k = None if shape is None or len(shape) != 3 or shape[2] % 16 else shape[2] // 16
                if first:
                    k, first = lin_k, False
                elif lin_k != k:
                    return None
        return k

    def partition(self) -> dict[int, list[int]]:
        """K -> sorted expert ids (from tensor shapes; experts with inconsistent K are left out)."""
        tiers: dict[int, list[int]] = {}
        for e in sorted(self.experts):
            k = self.expert_k(e)
            if k is not None:
                tiers.setdefault(k, []).append(e)
        return dict(sorted(tiers.items()))


class Declarations:
    """What a dialect's metadata declares beyond the model's shared fields, typed by the dialect that read it: each
    dialect's package subclasses this (dialects/tr3/declared.py `Tr3Declarations`, ...) and is the only reader of
    its fields; everything else asks the dialect. The base declares nothing."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"


class TensorFiles(Mapping[str, str]):
    """name -> file of every tensor, read from the tensors themselves: the index of a checkpoint whose index maps
    every tensor to the file holding it (`Checkpoint.index_agrees`), without a dict of its own (~935k entries)."""

    def __init__(self, tensors: Mapping[str, TensorRef]) -> None:
        self._tensors = tensors

    @property
    def tensors(self) -> Mapping[str, TensorRef]:
        """The tensors whose files these are."""
        return self._tensors

    def __getitem__(self, name: str) -> str:
        return self._tensors[name].file

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def values(self) -> ValuesView[str]:
        return _Files(self)


_FILE_OF = attrgetter("file")


class _Files(ValuesView[str]):
    _mapping: TensorFiles

    def __iter__(self) -> Iterator[str]:
        return map(_FILE_OF, self._mapping._tensors.values())  # in C: the rules ask for the set of files


@dataclass
class Checkpoint:
    """A parsed checkpoint: declarations from JSON, facts from headers, nothing from tensor data."""

    source: Source
    dialect: str
    config: dict[str, Any]
    hidden: int | None  # hidden size (H)
    intermediate: int | None  # global MoE intermediate size (I); per rank = intermediate // tp
    num_experts: int | None
    tp: int  # 1 for unsliced checkpoints
    codebook: str | None  # declared codebook
    rotation_layout: str  # "per_expert_v1" | "shared_h_v1" | "r7_shared" | "n/a"
    layers: dict[int, MoeLayer] = field(default_factory=dict)
    headers: dict[str, Any] = field(default_factory=dict)  # file -> header.Header
    declared: Declarations = field(default_factory=Declarations)  # its dialect's own, typed by that dialect
    index_metadata: dict[str, Any] | None = None  # the index's "metadata" object (total_size, ...), when present
    k_source: dict[int, str] = field(default_factory=dict)  # layer -> where its declared K list came from
    inferred: list[str] = field(default_factory=list)  # geometry facts read from tensors, not declared
    # Problems met while parsing that do not stop parsing; validate reports them as findings.
    parse_findings: list[Any] = field(default_factory=list)
    # every tensor by name (first file that has it): a dict, or the headers themselves (checkpoint/tensor_map.py)
    tensors: MutableMapping[str, TensorRef] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)  # every file of the checkpoint with its size
    index: Mapping[str, str] | None = None  # model.safetensors.index.json weight_map, when present
    index_file: str | None = None
    index_agrees: bool = False  # `index` maps every tensor to the file holding it, as the opening proved
    quant_config: dict[str, Any] | None = None  # quantization_config.json, when present

    @property
    def count_limit(self) -> int:
        """The largest count of MoE layers, experts per layer or ranks these files can describe.

        Each declared item needs tensors of its own, so a count above the number of tensors present is
        implausible: it is reported once (`count.implausible`) instead of being expanded into one finding,
        or one object, per item.
        """
        return max(len(self.tensors), MIN_COUNT_LIMIT)

    @property
    def intermediate_per_rank(self) -> int | None:
        return None if self.intermediate is None else self.intermediate // max(self.tp, 1)

    def moe_sizes(self) -> tuple[int, int]:
        """(hidden, intermediate) for code that reads expert data. The checks before it (validate, a repack's plan)
        refuse a source that lacks either, so the refusal here is the last line of defence, not the first."""
        if self.hidden is None or self.intermediate is None:
            raise CheckFailed("the source declares no hidden or intermediate size")
        return self.hidden, self.intermediate
