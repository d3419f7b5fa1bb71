"""The `Dialect` interface: everything one checkpoint format owns, in one object per dialect name.

validate, inspect, repack and bench never compare a checkpoint's dialect name: they ask its Dialect (through
`registry.dialect_of`) for the answer. A method or trait left at its default here means "nothing of that kind":
no own rules, no conversion, read by no profiled loader.

docs/architecture.md ("Dialects") shows this page and how to add a dialect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

from trellis_cli.checkpoint.model import Checkpoint, MoeLayer, VectorRef
from trellis_cli.findings import Location, Report
from trellis_cli.integrity import RecordedHash

# The loader families of the engine profiles (validate/engines.py): whose container reader is asked.
VLLM, B12X, EXLLAMAV3 = "vllm", "b12x", "exllamav3"
# The fork's R7 loader version (also reads TR3 and tensor_storage) and its mainline exl3-manifest loader.
VLLM_R7, VLLM_MANIFEST = "vllm-r7", "vllm-manifest"
# b12x 1.3.0, the release before the exl3-v1 rename: its BTX reader and its sqg-era b12x_trellis parser.
B12X_130 = "b12x-1.3.0"


@dataclass(frozen=True)
class Probe:
    """What detection may look at: the file listing and the JSON metadata. Never tensor data, never a name
    pattern of a layer file."""

    files: dict[str, int]
    config: dict[str, Any] | None
    quant_config: dict[str, Any] | None
    read_json: Callable[[str], Any]


@dataclass
class DialectInfo:
    """What detection found: the dialect's name and the declarations opening needs."""

    dialect: str
    rotation_layout: str
    tp: int
    codebook: str | None
    declared: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ContainerRefusal:
    """Why one loader family does not read this dialect's container at all: a named refusal, never a skip."""

    reason: str  # a few words for the compatibility line
    message: str
    expected: str | None = None
    found: str | None = None  # None: the checkpoint's dialect name
    code: str = "engine.container"  # another code: a refusal of the checkpoint's declarations (loader_refusal)
    where: Location | None = None  # the field it is about, where one is


@dataclass(frozen=True)
class ShardLayout:
    """How a per-linear dialect stores one MoE layer's expert tensors: its answer to validate's shared shard rules
    (rules_tensors), which hold for every such dialect and ask this instead of a name or a trait."""

    rank_sliced: bool = False  # every linear under .rank{r}. for each rank of tp, one K per expert, a fixed count
    shared_h: bool = False  # hidden-side vectors once per (projection, rank) in experts.shared_h (shared_h_v1)
    r7_shared: bool = False  # hidden-side vectors in experts.r7_shared (R7 v2), not under each linear
    k_declared_by: str = "the declared K map"  # how a message names a per-projection K declaration


@dataclass(frozen=True)
class CheckRequest:
    """One validation as a dialect's own rules see it; `layers` is the selection, already checked present."""

    layers: list[int]
    deep: bool
    checksums: bool
    narrowed: bool = False  # --layers was given (a dialect that cannot narrow its checks says so)
    known_digests: dict[str, str] = field(default_factory=dict)  # sha256 already found this run (file -> hex)
    progress: Callable[[str, int, int], None] | None = None
    checksum_progress: Callable[[int], None] | None = None


class StagedOutput(Protocol):
    """What a dialect's writer is handed by repack: the staged tree that becomes OUT. Repack owns the staging
    (OUT.partial, its lock, resume, the move into place); the writer only asks it where each file goes."""

    path: Path  # the staged tree

    def file(self, name: str, what: str = "output file") -> Path:
        """The path of `name` in the tree: a plain name under it (else a `path.escape` refusal), folder made."""
        ...


class Dialect:
    """One on-disk format. Subclasses set the traits and override what they own."""

    name: str = ""  # the Checkpoint.dialect value and the report's "dialect"
    target: str | None = None  # what `repack --to` calls it when it is a conversion target
    described_as: str = ""  # "an exl3-v1": how a message names a checkpoint of it
    # Traits the shared rules read instead of a name:
    shard_rules: bool = False  # per-linear EXL3 tensors in safetensors shards: validate's shard rules apply
    hybrid_tr3_tail: bool = False  # the rank-sliced TR3 contract in config.json
    shared_h: bool = False  # hidden-side vectors once per expert (shared_h_v1)
    tensor_storage: bool = False  # plain exllamav3 per-linear names and tensor_storage
    r7_maps: bool = False  # R7 per-projection K maps
    default_engine: str | None = None  # the profile validate enforces without --engine
    tensor_data: bool = True  # --deep reads its vectors (False: its values are covered by recorded hashes)
    records_hashes: bool = False  # its own metadata records each file's sha256
    holds_model_weights: bool = True  # its files hold the model's weights (False: a config block alone)
    publisher_digests: bool = False  # with --checksums, the publisher's hashes are compared first and reused
    inspect_view: str = "shards"  # which inspect document describes it: "shards", "slot-rows" or "route-pack"
    read_by: frozenset[str] = frozenset()  # the loader families that open this container
    container_notes: dict[str, str] = {}  # family -> why it does not, where that says more than the default
    # Conversions this dialect writes: source dialect name -> the repack driver that writes it.
    converts_from: dict[str, str] = {}
    # The module of this package that lays out a conversion's output (which files, tensors and declarations it
    # holds), handed the staged tree by repack's driver; set wherever `converts_from` is.
    writer: str | None = None

    def detect(self, probe: Probe) -> DialectInfo | None:
        """This dialect's DialectInfo when the metadata says so, None when it is not this dialect; raise
        UnknownDialect when the metadata claims this dialect but cannot be read as it."""
        return None

    def fill(self, ckpt: Checkpoint, probe: Probe, info: DialectInfo) -> bool:
        """Fill `ckpt` its own way and return True; False leaves it to the shared shard reader."""
        return False

    def check(self, ckpt: Checkpoint, request: CheckRequest, report: Report) -> None:
        """This dialect's own rules (header, config, tensor, --deep data, checksums), as findings in `report`.

        The shared rules (validate's shard rules where `shard_rules`, the data and hash rules of every dialect)
        run besides these."""

    def shard_layout(self, ckpt: Checkpoint, layer: MoeLayer) -> ShardLayout:
        """How MoE layer `layer` stores its per-linear expert tensors (where `shard_rules`)."""
        return ShardLayout()

    def vectors(self, ckpt: Checkpoint, layer: int) -> Iterator[VectorRef]:
        """Every suh / svh vector of MoE layer `layer`, for the shared data rules; by default those of the
        per-linear shards (one per linear and rank, and a shared_h_v1 layer's shared rows)."""
        moe = ckpt.layers.get(layer)
        if moe is None:
            return
        for expert, projs in moe.experts.items():
            for proj, by_rank in projs.items():
                for rank, lin in by_rank.items():
                    for kind in ("suh", "svh"):
                        ref = getattr(lin, kind)
                        if ref is not None and ref.dtype in ("F16", "BF16", "F32"):
                            yield VectorRef(Location(None, layer, expert, proj, rank, ref.name), kind, ref)
        for fields in moe.shared_h.values():
            for ref in fields.values():
                yield VectorRef(Location(layer=layer, tensor=ref.name), "suh", ref)

    def names_reported(self, ckpt: Checkpoint) -> set[str]:
        """Files whose names its opening or its own rules already check (validate's shared name rule leaves them
        out); by default the safetensors shards, which the shared shard reader checks before reading a header."""
        return {name for name in ckpt.files if name.endswith(".safetensors")}

    def declared_layers(self, ckpt: Checkpoint) -> list[int]:
        """The MoE layers `--layers` may name."""
        return list(ckpt.layers)

    def hashes_by_default(self, ckpt: Checkpoint) -> bool:
        """Whether validate compares recorded hashes without --checksums (a container that records its own)."""
        return False

    def recorded_hashes(self, ckpt: Checkpoint, request: CheckRequest) -> list[RecordedHash]:
        """The sha256 its own metadata records for the files `request` covers, each with the finding a
        mismatch is; validate's one checksum rule (validate/checksums.py) compares them. None recorded: []."""
        return []

    def container_refusal(self, family: str) -> ContainerRefusal | None:
        """Why loader `family` (VLLM, B12X, EXLLAMAV3) does not read this container; None when it does."""
        if family in self.read_by:
            return None
        if family == VLLM:
            why = self.container_notes.get(VLLM, "not a layout this loader reads")
            return ContainerRefusal("wrong container", f"{self.described_as} checkpoint: {why}",
                                    expected="hybrid_tr3_tail or tensor_storage")
        if family == VLLM_R7:
            return ContainerRefusal("wrong container", f"{self.described_as} checkpoint: this loader reads "
                                    "hybrid_tr3_tail, r7_routed_experts or tensor_storage",
                                    expected="TR3, R7 or plain EXL3")
        if family == VLLM_MANIFEST:
            return ContainerRefusal("wrong container", f"{self.described_as} checkpoint: this loader reads "
                                    "routed experts only from a b12x exl3-manifest.json container",
                                    expected="exl3-v1")
        if family == B12X:
            return ContainerRefusal("wrong container", f"{self.described_as} checkpoint: the exl3-v1 reader opens "
                                    "exl3-manifest.json and the layer files it lists, which this is not",
                                    expected="exl3-v1")
        if family == B12X_130:
            return ContainerRefusal("wrong container", f"{self.described_as} checkpoint: b12x 1.3.0 reads BTX "
                                    "(btx-manifest.json) and sqg-era b12x_trellis blocks, which this is not",
                                    expected="BTX")
        return ContainerRefusal("wrong container", f"{self.described_as} checkpoint: exllamav3 reads per-linear "
                                "safetensors names only")

    def loader_refusal(self, ckpt: Checkpoint, family: str) -> ContainerRefusal | None:
        """Why loader `family`, which reads this container, still refuses this checkpoint's own declarations (a
        release's parser or runtime; named by rule, version and field); None when it does not."""
        return None

    def rank_tp_degrees(self, ckpt: Checkpoint) -> list[int] | None:
        """The TP degrees a rank slice can be cut at, when the container fixes them; None: any exact re-slice."""
        return None

    def tp_partitions(self, ckpt: Checkpoint, tp: int) -> list[dict[str, Any]] | None:
        """How each known planner cuts its layers into rank extents at `tp` (each named with its version), where
        that is the container's, not the checkpoint's, choice; None: the layout fixes it."""
        return None

    def layer_pack(self, ckpt: Checkpoint, layer: int, rank: int, tp: int | None = None, device: str = "cpu") -> Any:
        """One (layer, rank) of target TP `tp` (None: the source's) as the LayerPack a repack would write."""
        from trellis_cli.routepack.pack import pack_layer

        if tp is None:
            return pack_layer(ckpt, layer, rank, device=device)
        return pack_layer(ckpt, layer, rank, device=device, tp=tp)

    def __repr__(self) -> str:
        return f"<dialect {self.name}>"
