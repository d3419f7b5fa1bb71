"""An exl3-v1 checkpoint in the normalized model: the manifest, each layer file's header, and its rate tables.

`fill_checkpoint` runs inside open_checkpoint once the dialect is known. It reads the manifest (already read
for detection) and the header of every layer file the manifest names, and nothing else: layer files hold
tensors with the same names ("codes", "rotations", ...), so they are kept per layer (`Exl3Layer.tensors`)
instead of in `Checkpoint.tensors`. Rate tables are tensor data, but tiny ([num_slots/8, E] bytes): they are
read on first use by `layer_rates`, from local files only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trellis_cli.checkpoint import reader
from trellis_cli.checkpoint.model import Checkpoint, Declarations, MoeLayer, TensorRef
from trellis_cli.errors import CheckFailed
from trellis_cli.dialects.exl3v1.layout import LayerRates, uniform_rates
from trellis_cli.dialects.exl3v1.schema import SLOTS_PER_PAIR, Manifest, parse_manifest
from trellis_cli.findings import Location, error, warning
from trellis_cli.sources import Source

CODES, ROTATIONS, RATES_FC1, RATES_FC2, SIGN_PATTERN = "codes", "rotations", "rates_fc1", "rates_fc2", "sign_pattern"
HIDDEN_TABLES = ("gate_suh", "up_suh", "down_svh")  # matrix order: gate, up, down
METADATA_KEYS = ("schema", "codebook", "layer", "num_experts", "hidden_size", "intermediate_size", "slot_channels")


@dataclass
class Exl3Layer:
    index: int
    file: str
    sha256: str
    tensors: dict[str, TensorRef] = field(default_factory=dict)  # by name inside the layer file
    metadata: dict[str, str] | None = None
    readable: bool = False  # the header parsed

    def ref(self, name: str) -> TensorRef | None:
        return self.tensors.get(name)

    def required(self, name: str) -> TensorRef:
        """The tensor `name` of this layer file, for code past the container's checks (which report a missing one);
        CheckFailed naming the file and tensor if it is absent all the same."""
        ref = self.tensors.get(name)
        if ref is None:
            raise CheckFailed(f"{self.file}: {name}: not in the layer file")
        return ref


@dataclass
class Exl3Container:
    manifest_file: str
    manifest: Manifest | None
    layers: dict[int, Exl3Layer] = field(default_factory=dict)
    rates: dict[int, LayerRates | None] = field(default_factory=dict)  # cache of layer_rates


@dataclass
class Exl3v1Declarations(Declarations):
    """An exl3-v1 (or BTX) checkpoint's declarations: the manifest as detection read it (declared.py), until
    opening turns it into the container in the model."""

    manifest_file: str | None  # the manifest diff compares as a declaration document (None: none, as for BTX)
    config_manifest: str | None = None  # another manifest name config.json gives (never read by b12x)
    manifest_doc: Any = None  # the parsed manifest JSON, handed to `fill_checkpoint` and then dropped
    container: Exl3Container | None = None  # the container in the model, once opened


def declarations(ckpt: Checkpoint) -> Exl3v1Declarations | None:
    """The checkpoint's exl3-v1 declarations (an exl3-v1 or BTX checkpoint's), else None."""
    declared = ckpt.declared
    return declared if isinstance(declared, Exl3v1Declarations) else None


def container(ckpt: Checkpoint) -> Exl3Container:
    """The opened container of an exl3-v1 (or BTX) checkpoint."""
    box = container_or_none(ckpt)
    if box is None:
        raise TypeError(f"{ckpt.dialect}: not an opened exl3-v1 container")
    return box


def parsed_manifest(ckpt: Checkpoint) -> Manifest:
    """The manifest of an opened exl3-v1 (or BTX) container, for code past validation (which reports one that did
    not parse); CheckFailed naming the file if it did not all the same."""
    box = container(ckpt)
    if box.manifest is None:
        raise CheckFailed(f"{box.manifest_file}: the manifest cannot be read (trellis validate says why)")
    return box.manifest


def container_or_none(ckpt: Checkpoint) -> Exl3Container | None:
    """The opened container, or None when `ckpt` is not an exl3-v1 container or was not opened as one."""
    declared = declarations(ckpt)
    return declared.container if declared is not None else None


def expected_metadata(m: Manifest, layer: int) -> dict[str, str]:
    """The identity keys a layer file's safetensors metadata must carry, as strings."""
    return {"schema": "exl3-v1", "codebook": m.codebook, "layer": str(layer), "num_experts": str(m.num_experts),
            "hidden_size": str(m.hidden), "intermediate_size": str(m.intermediate), "slot_channels": "32"}


def fill_checkpoint(ckpt: Checkpoint, source: Source, files: dict[str, int], manifest_file: str,
                    declared: Exl3v1Declarations) -> None:
    """The container read from `declared.manifest_doc` (the parsed `manifest_file`) into `ckpt`, kept as
    `declared.container`; the document itself is dropped. No document: the directory has no `manifest_file`,
    only the other manifest config.json names."""
    doc, declared.manifest_doc = declared.manifest_doc, None
    ckpt.parse_findings.extend(_config_manifest_findings(manifest_file, declared.config_manifest, doc is None))
    manifest, findings = parse_manifest(doc, manifest_file) if doc is not None else (None, [])
    ckpt.parse_findings.extend(findings)
    box = declared.container = Exl3Container(manifest_file, manifest)
    if manifest is None:
        return
    ckpt.hidden, ckpt.intermediate, ckpt.num_experts = manifest.hidden, manifest.intermediate, manifest.num_experts
    ckpt.codebook = manifest.codebook
    ckpt.rotation_layout = "per_expert_v1" if manifest.per_expert_input_rotations else "shared_h_v1"
    for index, entry in manifest.layers.items():
        layer = box.layers[index] = Exl3Layer(index, entry.file, entry.sha256)
        ckpt.layers[index] = MoeLayer(index, files={entry.file})
        _read_layer_header(ckpt, source, files, layer)
    ckpt.layers = dict(sorted(ckpt.layers.items()))


def _config_manifest_findings(manifest_file: str, named: str | None, missing: bool) -> list:
    """b12x's reader opens `manifest_file` only: a manifest config.json names under another name is never read
    (an error when it is the only one, a warning beside the real one, which is what gets validated)."""
    if named is None:
        return []
    where = Location(file="config.json", tensor="quantization_config.exl3.manifest")
    if missing:
        return [error("exl3v1.manifest-name", where, f"the exl3-v1 manifest is only under the name config.json "
                      f"gives; b12x's reader opens {manifest_file} and nothing else, so it finds no manifest",
                      manifest_file, named)]
    return [warning("exl3v1.manifest-name", where, f"config.json names another manifest than the one b12x's reader "
                    f"opens: {manifest_file} is what loads and what is validated here; {named} is never read",
                    manifest_file, named)]


def _read_layer_header(ckpt: Checkpoint, source: Source, files: dict[str, int], layer: Exl3Layer) -> None:
    where = Location(file=layer.file, layer=layer.index)
    if source.escapes(layer.file):
        ckpt.parse_findings.append(error("path.escape", where, "the layer file resolves outside the checkpoint "
                                         "directory (symlink)"))
        return
    if layer.file not in files:
        ckpt.parse_findings.append(error("exl3v1.layer-file-missing", where, "the manifest names a layer file "
                                         "that is not in the checkpoint"))
        return
    if files[layer.file] < 0:
        ckpt.parse_findings.append(error("path.dangling", where, "the layer file is a dangling link"))
        return
    try:
        header = reader.shard_header(ckpt, layer.file)
    except CheckFailed as e:
        ckpt.parse_findings.append(error("file.header", where, str(e)))
        return
    ckpt.headers[layer.file] = header
    layer.readable = True
    layer.metadata = header.metadata if isinstance(header.metadata, dict) else None
    for name, entry in header.tensors.items():
        layer.tensors[name] = TensorRef(name, layer.file, entry.dtype, entry.shape, entry.begin, entry.end,
                                        header.data_start)


def rate_table_shape(m: Manifest) -> tuple[int, int]:
    return (m.num_slots // SLOTS_PER_PAIR, m.num_experts)


def layer_rates(ckpt: Checkpoint, index: int) -> LayerRates | None:
    """The layer's rate bytes; None when the tables are absent, malformed or not readable here."""
    box = container(ckpt)
    m = box.manifest
    if m is None or index not in box.layers:
        return None
    if not m.pair_structure:
        assert m.bits is not None  # the parser requires bits of uniform rates
        return uniform_rates(m.bits)
    if index not in box.rates:
        box.rates[index] = _read_rates(ckpt, m, box.layers[index])
    return box.rates[index]


def _read_rates(ckpt: Checkpoint, m: Manifest, layer: Exl3Layer) -> LayerRates | None:
    from trellis_cli.checkpoint.tensors import read_tensor

    tables = []
    for name in (RATES_FC1, RATES_FC2):
        ref = layer.ref(name)
        if ref is None or ref.dtype != "U8" or tuple(ref.shape) != rate_table_shape(m) or not local_file(ckpt, ref):
            return None
        try:
            tables.append(tuple(tuple(row) for row in read_tensor(ckpt, ref).tolist()))
        except CheckFailed:
            return None
    return LayerRates(None, tables[0], tables[1])


def local_file(ckpt: Checkpoint, ref: TensorRef | None) -> bool:
    """True when the file's bytes are on this machine (a local directory, or a Hub file already cached); a
    remote layer file with no tensor to name it is not."""
    return ckpt.source.root is not None or (ref is not None and ckpt.source.cached_path(ref.file) is not None)


def finding_where(layer: Exl3Layer, tensor: str | None = None) -> Location:
    return Location(file=layer.file, layer=layer.index, tensor=tensor)


__all__ = ["CODES", "Exl3Container", "Exl3Layer", "Exl3v1Declarations", "HIDDEN_TABLES", "METADATA_KEYS", "ROTATIONS",
           "container", "container_or_none", "declarations", "expected_metadata", "fill_checkpoint", "layer_rates"]
