"""The `Dialect` interface: everything one checkpoint format owns, in one object per dialect name.

validate, inspect, fit, diff, repack and bench never compare a checkpoint's dialect name or the layout of its
bytes: they ask its Dialect (through `registry.dialect_of`) for the answer. A method or trait left at its default
here means "nothing of that kind" (no own rules, no conversion, read by no profiled loader), and where a command
asks about bytes (diff's units, fit's weights, inspect's document and files), the default answers for per-linear
safetensors shards, so a new shard dialect works without overriding them.

docs/architecture.md ("Dialects") shows this page and how to add a dialect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from trellis_cli.checkpoint.declared import Declared
from trellis_cli.checkpoint.model import Checkpoint, Declarations, MoeLayer, VectorRef
from trellis_cli.errors import CheckFailed
from trellis_cli.formats.layer_pack import LayerPack
from trellis_cli.findings import Location, Report
from trellis_cli.integrity import RecordedHash

if TYPE_CHECKING:
    from trellis_cli.dialects.inspect_doc import InspectSummary
    from trellis_cli.dialects.units import BulkUnits, Key, Unit

CONFIG, QUANT_CONFIG = "config.json", "quantization_config.json"

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

    def embedded(self) -> dict[str, Any] | None:
        """config.json's own `quantization_config`, when it is an object."""
        embedded = (self.config or {}).get("quantization_config")
        return embedded if isinstance(embedded, dict) else None

    def quant_methods(self) -> list[Any]:
        """The `quant_method` of the embedded quantization config, then of quantization_config.json."""
        return [q.get("quant_method") for q in (self.embedded(), self.quant_config) if q is not None]

    def quant_object(self, key: str) -> dict[str, Any] | None:
        """The first quantization config (embedded, then external) whose `key` is an object: that object."""
        for q in (self.embedded(), self.quant_config):
            if q is not None and isinstance(q.get(key), dict):
                found: dict[str, Any] = q[key]
                return found
        return None

    def quant_codebook(self) -> str | None:
        """The first quantization config's `codebook` that is a string."""
        for q in (self.embedded(), self.quant_config):
            if q is not None and isinstance(q.get("codebook"), str):
                codebook: str = q["codebook"]
                return codebook
        return None


@dataclass
class DialectInfo:
    """What detection found: the dialect's name and its declarations, typed by the dialect that read them (a
    `Declarations` of its own package; the Checkpoint holds them as `declared`)."""

    dialect: str
    rotation_layout: str
    tp: int
    codebook: str | None
    declared: Declarations = field(default_factory=Declarations)


def declared_tp(value: Any) -> int:
    """A declared TP as the loaders that coerce with int() read it; 1 when it is not a positive count (the
    shared-H version's refusal of a string is its own engine rule)."""
    from trellis_cli.header import coerced_int

    n = coerced_int(value)
    return n if n is not None and n > 0 else 1


@dataclass(frozen=True)
class ContainerRefusal:
    """Why one loader family does not read this dialect's container at all: a named refusal, never a skip."""

    reason: str  # a few words for the compatibility line
    message: str
    expected: Any = None
    found: Any = None  # a container refusal's None: the checkpoint's dialect name
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
    # None: every loader that reads this layer takes its K from the declaration, so a declaration that disagrees
    # with the trellis shapes is an error. Else why not (which loaders read what): the disagreement is a warning
    # and each loader profile judges the layer by what its loader reads.
    k_map_note: str | None = None


@dataclass(frozen=True)
class RankShare:
    """What one rank reads of one MoE layer of a container that places its own bytes per rank (`layer_shares`)."""

    nbytes: int  # every byte of the layer this rank reads
    experts: list[tuple[int | None, int]] | None  # per routed expert, in id order: (K or None when mixed, bytes);
    # None where the layer's rates are not read (an MTP layer, a rate table that cannot be read)


@dataclass(frozen=True)
class LayerShare:
    """One MoE layer's bytes, whole and per rank, at the TP `layer_shares` was asked about."""

    layer: int
    nbytes: int  # the whole layer (every rank's extent together)
    ranks: list[RankShare]


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
    """What a dialect's writer and a conversion's driver are handed by repack: the staged tree that becomes OUT.
    Repack owns the staging (OUT.partial, its lock, resume, the move into place); the writer asks it where each
    file goes, the driver also what an earlier run finished and what this one has."""

    path: Path  # the staged tree
    done: dict[str, dict[str, Any]]  # every finished file -> its entry (sha256, size, ...) as `record` kept it

    def file(self, name: str, what: str = "output file") -> Path:
        """The path of `name` in the tree: a plain name under it (else a `path.escape` refusal), folder made."""
        ...

    def completed(self, name: str, sources: dict[str, str]) -> bool:
        """Whether an earlier run finished `name` from source files of these sha256, and it still holds."""
        ...

    def record(self, name: str, entry: dict[str, Any], sources: dict[str, str]) -> None:
        """`name` is finished and verified; `sources`: sha256 of every source file it was made from."""
        ...


def read_json_or_none(ckpt: Checkpoint, name: str) -> Any:
    """A small JSON file of the checkpoint, or None when it is absent or unreadable (validate's finding)."""
    from trellis_cli.errors import CheckFailed

    if name not in ckpt.files:
        return None
    try:
        return ckpt.source.read_json(name)
    except CheckFailed:
        return None


class Dialect:
    """One on-disk format. Subclasses set the traits and override what they own."""

    name: str = ""  # the Checkpoint.dialect value and the report's "dialect"
    target: str | None = None  # what `repack --to` calls it when it is a conversion target
    described_as: str = ""  # "an exl3-v1": how a message names a checkpoint of it
    # Traits the shared rules read instead of a name:
    shard_rules: bool = False  # per-linear EXL3 tensors in safetensors shards: validate's shard rules apply
    shared_h: bool = False  # hidden-side vectors once per expert (shared_h_v1)
    # How the vLLM fork's EXL3 loaders find its experts, for validate's engine rules (the rank-sliced path is
    # `rank_sliced_contract`): the generic path (per-module records, experts sliced per rank at load) ...
    module_records: bool = False
    # ... or the R7 version's per-projection K maps (experts streamed and sliced per rank at load).
    streamed_k_maps: bool = False
    # Opening (dialects/open.py) asks these instead of a name: whether its TP is one more than the highest rank
    # id of its tensor names (not declared) ...
    tp_from_rank_ids: bool = False
    # ... and whether its listing and JSON alone declare TP, layout and K per expert (a dry run's plan, no header).
    declared_opening: bool = False
    # Whether `detect` decides from the listing and its own manifest before config.json is read, and opening then
    # reads nothing more: its own verifier owns every file, config.json included (a damaged one is its finding,
    # not a reason to stop). Such dialects are asked first, in registry order.
    opens_from_listing: bool = False
    default_engine: str | None = None  # the profile validate enforces without --engine
    tensor_data: bool = True  # --deep reads its vectors (False: its values are covered by recorded hashes)
    records_hashes: bool = False  # its own metadata records each file's sha256
    holds_model_weights: bool = True  # its files hold the model's weights (False: a config block alone)
    publisher_digests: bool = False  # with --checksums, the publisher's hashes are compared first and reused
    read_by: frozenset[str] = frozenset()  # the loader families that open this container
    container_notes: dict[str, str] = {}  # family -> why it does not, where that says more than the default
    # Conversions this dialect writes: source dialect name -> the repack driver that writes it.
    converts_from: dict[str, str] = {}
    # Each driver `converts_from` names: driver name -> "module:factory", the factory (a `conversion.Driver`
    # class, or a function making one) called with (source, OUT, options, validator). A driver lives in the
    # package of its target or of its source; repack's staged run runs it (repack/drivers.py resolves it).
    drivers: dict[str, str] = {}
    # The module of this package that lays out a conversion's output (which files, tensors and declarations it
    # holds), handed the staged tree by repack's driver; set wherever `converts_from` is.
    writer: str | None = None
    # Its module that writes synthetic checkpoints for `trellis synth --format` (checkpoint_bytes, summary and
    # write_checkpoint of a SynthSpec); None: synth does not write it.
    synth: str | None = None

    def detect(self, probe: Probe) -> DialectInfo | None:
        """This dialect's DialectInfo (its declarations typed by its own package) when the metadata says so, None
        when it is not this dialect; raise UnknownDialect when the metadata claims this dialect but cannot be
        read as it. Where `opens_from_listing`, `probe.config` and `probe.quant_config` are None."""
        return None

    def fill(self, ckpt: Checkpoint, probe: Probe, info: DialectInfo) -> bool:
        """Fill `ckpt` its own way and return True; False leaves it to the shared shard reader."""
        return False

    def declarations(self, ckpt: Checkpoint, info: DialectInfo, read_json: Callable[[str], Any],
                     files: dict[str, int]) -> Declared | None:
        """Its per-layer declarations parsed from its own metadata (`info.declared`, what its `detect` read), for
        the shared shard reader (checkpoint/declared.py `Declared`: K per expert or per (expert, projection), and
        where each layer's came from); it may add the MoE layers it declares to `ckpt.layers`. None: it declares
        none."""
        return None

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

    def scope_declared(self, ckpt: Checkpoint) -> str | None:
        """Where `ckpt` (of any dialect) declares this dialect's loader scope, a quantization block a loader version
        gates exactly: "config.json" (its own quantization_config, what the loader reads) or the other file that
        declares it; None when it declares none."""
        return None

    def scope_refusals(self, ckpt: Checkpoint, layers: list[int], part: str) -> list[ContainerRefusal]:
        """What the loader version that reads this dialect's scope refuses of a checkpoint declaring it in
        config.json, each named by code: `part` "metadata" (the scope's exact keys and the model's architecture),
        "tensors" (the tensors of `layers` the scope fixes) or "external" (a scope only another file declares,
        which that loader never sees). [] when there is nothing to refuse."""
        return []

    def rank_tp_degrees(self, ckpt: Checkpoint) -> list[int] | None:
        """The TP degrees a rank slice can be cut at, when the container fixes them; None: any exact re-slice."""
        return None

    def tp_partitions(self, ckpt: Checkpoint, tp: int) -> list[dict[str, Any]] | None:
        """How each known planner cuts its layers into rank extents at `tp` (each named with its version), where
        that is the container's, not the checkpoint's, choice; None: the layout fixes it."""
        return None

    def layer_pack(self, ckpt: Checkpoint, layer: int, rank: int, tp: int | None = None,
                   device: str = "cpu") -> LayerPack:
        """One (layer, rank) of target TP `tp` (None: the source's) as the LayerPack a repack would write."""
        from trellis_cli.dialects.shard_pack import pack_layer

        if tp is None:
            return pack_layer(ckpt, layer, rank, device=device)
        return pack_layer(ckpt, layer, rank, device=device, tp=tp)

    # ---- a directory that stores each (layer, rank) as a LayerPack file, read as stored (no opening) ---------

    def holds_layer_packs(self, directory: Path) -> bool:
        """Whether local `directory` is a checkpoint of this dialect that stores each (layer, rank) as a LayerPack
        file: bench times its files as they are, and repack converts it from its directory."""
        return False

    def stored_layer_packs(self, directory: Path) -> list[int]:
        """The MoE layers such a directory stores, as its own metadata lists them (SourceUnavailable when that
        cannot be read)."""
        return []

    def layer_pack_tp(self, directory: Path) -> Any:
        """The TP such a directory was written for, as its metadata says it (None when it does not)."""
        return None

    def layer_pack_path(self, directory: Path, layer: int, rank: int) -> Path:
        """The file of (layer, rank) in such a directory."""
        raise CheckFailed(f"{directory}: {self.described_as} checkpoint stores no LayerPack files")

    def read_layer_pack(self, directory: Path, layer: int, rank: int, device: str = "cpu") -> LayerPack:
        """One (layer, rank) of such a directory (or the layer file `directory` itself), as stored."""
        raise CheckFailed(f"{directory}: {self.described_as} checkpoint stores no LayerPack files")

    def rank_sliced_contract(self, ckpt: Checkpoint) -> dict[str, Any] | None:
        """The rank-sliced contract its config.json declares, as the fork's rank-sliced path reads it (a
        checkpoint served at exactly its recorded tp); None when it declares none."""
        return None

    def bit_map_problems(self, ckpt: Checkpoint) -> list[tuple[str, Any, Any]]:
        """What is wrong with the per-layer bit map of its rank-sliced contract, for the loader version that
        reads one: (problem, expected, found) each; [] when there is none or nothing is wrong."""
        return []

    def slot_manifest(self, ckpt: Checkpoint) -> tuple[Any, str] | None:
        """Its exl3-manifest.json container's parsed manifest (dialects/exl3v1/schema.py `Manifest`) and the
        manifest's file name, for the loaders that read such a container; None: not one, or it did not parse."""
        return None

    # ---- what diff, fit and inspect ask of its bytes (defaults: per-linear safetensors shards) ----------------

    def stored_tp(self, ckpt: Checkpoint) -> int | None:
        """The TP its ranks are stored at; None when a rank is an extent cut when read (exl3-v1's slots)."""
        return max(ckpt.tp, 1)

    def read_tp(self, ckpt: Checkpoint) -> int:
        """The TP two checkpoints without a stored TP are compared at (diff), read from this one."""
        return max(ckpt.tp, 1)

    def compared_layers(self, ckpt: Checkpoint) -> list[int]:
        """The MoE layers diff compares (what its bytes hold, declared or not)."""
        return sorted(ckpt.layers)

    def layer_units(self, ckpt: Checkpoint, layer: int, tp: int) -> dict[Key, Unit]:
        """Every logical unit of MoE layer `layer` at `tp` ranks (dialects/units.py: `Key` -> `Unit`), as diff
        compares them; a TP it cannot be read at is a CheckFailed naming why."""
        from trellis_cli.dialects.units import shard_layer_units

        return shard_layer_units(ckpt, layer, tp)

    def bulk_units(self, ckpt: Checkpoint, layer: int, tp: int) -> BulkUnits | None:
        """`layer_units` of `layer` at `tp` without a record per unit: their count, spans and summary facts
        (dialects/units.py `BulkUnits`); None where only the records can say."""
        from trellis_cli.dialects.units import shard_bulk_units

        if type(self).layer_units is not Dialect.layer_units:  # the columns describe the default's units only
            return None
        return shard_bulk_units(ckpt, layer, tp)

    def other_units(self, ckpt: Checkpoint) -> dict[Key, Unit]:
        """Every tensor outside the MoE expert layout as a unit keyed by its name (the first file holding it)."""
        from trellis_cli.dialects.units import shard_other_units

        # (layers the shared opening built from the tensors, not this dialect's own `fill`: counted, not named)
        return shard_other_units(ckpt, from_tensors=not self.opens_from_listing and type(self).fill is Dialect.fill)

    def layer_file_tensors(self, ckpt: Checkpoint, layer: int) -> dict[Key, Unit] | None:
        """A layer kept whole in one file, its tensors as units by name: how two checkpoints that both answer
        compare a layer (file to file first); None: its layers are not stored as such files."""
        return None

    def stored_expert_k(self, ckpt: Checkpoint, layer: int) -> dict[int, int | None] | None:
        """K per expert of `layer` from its own metadata, when its layer files are compared whole; None: unknown."""
        return None

    def model_facts(self, ckpt: Checkpoint) -> dict[str, Any]:
        """Model facts (diff's structure: hidden, num_experts, rotation_layout, ...) its own metadata gives
        where the model leaves them open; {}: the model's own."""
        return {}

    def declaration_documents(self, ckpt: Checkpoint) -> dict[str, Any]:
        """The JSON documents that declare it (file name -> parsed document), compared key by key by diff."""
        docs: dict[str, Any] = {}
        if ckpt.config:
            docs[CONFIG] = ckpt.config
        if ckpt.quant_config:
            docs[QUANT_CONFIG] = ckpt.quant_config
        return docs

    def layer_files(self, ckpt: Checkpoint) -> dict[str, int]:
        """Files that hold one MoE layer under tensor names without a layer number, and that layer; {}: every
        tensor name says its layer (the shards)."""
        return {}

    def loose_tensors(self, ckpt: Checkpoint) -> list[Any] | None:
        """The tensors outside its layer files (TensorRef), when its layers are not tensors of the shards; None:
        every tensor is in the model (`Checkpoint.tensors`)."""
        return None

    def codes_tables(self, ckpt: Checkpoint) -> dict[str, tuple[int, int]]:
        """File -> (offset of a codes table that mixes K per expert, the routed weights it encodes): inspect
        --tensors gives such a table a bpw and no K. {}: every codes tensor has one K (`.trellis`)."""
        return {}

    def weights_refusal(self, ckpt: Checkpoint) -> str | None:
        """Why `trellis fit` cannot count a served model's weights from it; None when it can."""
        return None

    def layer_shares(self, ckpt: Checkpoint, tp: int, rates_below: int) -> list[LayerShare] | None:
        """Each MoE layer's bytes per rank at `tp` where the container places them itself (rates read for layers
        below `rates_below`, the decoder's); None: its tensors are placed by the engine's sharding table."""
        return None

    def source_digests(self, ckpt: Checkpoint) -> dict[str, list[tuple[str, str, str]]]:
        """The sha256 its own metadata records per file, for a conversion's source-hash plan: file -> [(sha256,
        who records it, the finding code of a mismatch)]. {}: none recorded."""
        return {}

    def inspect_document(self, ckpt: Checkpoint, layers: list[int] | None) -> InspectSummary:
        """What `trellis inspect` shows (the chosen MoE layers, or all); by default the per-linear shard
        document (dialects/inspect_doc.py), a dialect's own extending its `InspectSummary`."""
        from trellis_cli.dialects.inspect_doc import shard_document

        return shard_document(ckpt, layers)

    def __repr__(self) -> str:
        return f"<dialect {self.name}>"
