"""What `run_diff` returns: plain data, every difference kept (renderers cap, this never does)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

ONLY_A, ONLY_B, DTYPE, SHAPE, BYTES = "only-a", "only-b", "dtype", "shape", "bytes"
STATUSES = (ONLY_A, ONLY_B, DTYPE, SHAPE, BYTES)


class _UnitFactsFields(TypedDict):
    dtype: str
    shape: list[int]
    bytes: int


class UnitFacts(_UnitFactsFields, total=False):
    """One side of a TensorDifference: what its unit is, in its JSON key order."""

    sha256: str  # when hashed


@dataclass(frozen=True)
class StructureChange:
    """One declaration that differs: `what` is where it lives (a file, or `checkpoint` for model facts)."""

    what: str
    key: str
    a: Any
    b: Any


@dataclass(frozen=True)
class TensorDifference:
    """One unit that is not identical. Routed-expert units carry layer/expert/projection/rank/part; a
    non-expert tensor carries its name in `tensor` (part `tensor`). `a`/`b`: dtype, shape, bytes, sha256 when
    hashed, None on the side that lacks it."""

    status: str
    method: str
    part: str
    layer: int | None = None
    expert: int | None = None
    projection: str | None = None
    rank: int | None = None
    tensor: str | None = None
    a: UnitFacts | None = None
    b: UnitFacts | None = None

    def label(self) -> str:
        if self.tensor is not None:
            return self.tensor
        expert = "shared" if self.expert is None else f"expert {self.expert}"
        return f"layer {self.layer} {expert} {self.projection} rank {self.rank} {self.part}"


@dataclass(frozen=True)
class TierChange:
    expert: int
    k_a: int | None
    k_b: int | None


@dataclass
class LayerDiff:
    """One MoE layer present on both sides: partitions, bpw and bytes per rank before and after, tier changes."""

    layer: int
    partition_a: dict[int, int]  # K -> number of experts
    partition_b: dict[int, int]
    bpw_a: float | None
    bpw_b: float | None
    bytes_per_rank_a: list[int]
    bytes_per_rank_b: list[int]
    tier_changes: list[TierChange] = field(default_factory=list)
    declared_changes: list[TierChange] = field(default_factory=list)  # tier bitmap / declared K per expert
    counts: dict[str, int] = field(default_factory=dict)  # identical + each status, over this layer's units
    methods: dict[str, int] = field(default_factory=dict)  # method -> units of this layer it decided


@dataclass(frozen=True)
class DiffSide:
    """One side of a diff: where it came from and what it is, in the key order of `diff --json`'s `a` and `b`."""

    description: str  # the source as reports name it
    source: dict[str, Any]  # Source.describe()
    dialect: str
    tp: int | None  # the TP its ranks are stored at; None: cut when read (a slot layout)
    codebook: str | None
    rotation_layout: str | None


@dataclass
class DiffResult:
    a: DiffSide
    b: DiffSide
    compared_tp: int | None
    layers_compared: list[int]
    structure: list[StructureChange] = field(default_factory=list)
    layers_only_a: list[int] = field(default_factory=list)
    layers_only_b: list[int] = field(default_factory=list)
    layers: list[LayerDiff] = field(default_factory=list)
    differences: list[TensorDifference] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("identical", *STATUSES), 0))
    methods: dict[str, int] = field(default_factory=dict)  # method -> units it decided
    other_tensors_compared: bool = True

    @property
    def identical(self) -> bool:
        """Identical in content: every unit on both sides and byte-identical, the same MoE layers."""
        return not self.differences and not self.layers_only_a and not self.layers_only_b

    def tier_change_count(self) -> int:
        return sum(len(layer.tier_changes) for layer in self.layers)

    def summary(self) -> str:
        c = self.counts
        units = sum(c.values())
        if self.identical:
            text = f"identical in content: {units:,} units compared"
        else:
            parts = [f"{c[s]:,} {s}" for s in STATUSES if c[s]]
            if self.layers_only_a or self.layers_only_b:
                parts.append(f"MoE layers only in A: {len(self.layers_only_a)}, only in B: {len(self.layers_only_b)}")
            tiers = self.tier_change_count()
            if tiers:
                parts.append(f"{tiers} expert(s) changed tier")
            text = f"different: {', '.join(parts)}; {c['identical']:,} of {units:,} units identical"
        if self.structure:
            text += f"; {len(self.structure)} declaration(s) differ"
        return text

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["identical"] = self.identical
        doc["summary"] = self.summary()
        for layer in doc["layers"]:  # JSON object keys are strings
            layer["partition_a"] = {str(k): v for k, v in layer["partition_a"].items()}
            layer["partition_b"] = {str(k): v for k, v in layer["partition_b"].items()}
        return doc
