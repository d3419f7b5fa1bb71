"""BTX (`btx-atoms-v1`): b12x 1.3.0's name for the container b12x 1.5.x calls exl3-v1.

btx-manifest.json plus one btx-layer-NNNNN.safetensors per MoE layer, with the exl3-v1 rules under other
names (`names.py`, the renaming table). trellis reads it as exl3-v1 seen through that table: opening renames
the manifest, the layer files' tensor names and metadata into the exl3-v1 model (so inspect, diff and fit
read it as they read exl3-v1), validation runs the exl3-v1 checks and says every finding in BTX words as a
`btx.*` code naming b12x 1.3.0, and `write.py` converts between the two spellings (`repack --to exl3-v1` /
`--to btx`) without touching a tensor byte. docs/checkpoint-dialects.md describes it.
"""

from __future__ import annotations


from trellis_cli.checkpoint.model import DIALECT_EXL3V1
from trellis_cli.dialects.btx import names
from trellis_cli.dialects.exl3v1 import Exl3v1Dialect
from trellis_cli.dialects.exl3v1.container import Exl3v1Declarations
from trellis_cli.dialects.interface import (B12X, B12X_130, VLLM, VLLM_MANIFEST, CheckRequest, ContainerRefusal,
                                            DialectInfo, Probe)
from trellis_cli.errors import UnknownDialect
from trellis_cli.findings import Report
from trellis_cli.integrity import RecordedHash

DIALECT_BTX = names.SCHEMA
RENAME = ("`trellis repack --to exl3-v1` renames it (payload bytes unchanged)")


class BtxDialect(Exl3v1Dialect):
    name = DIALECT_BTX
    target = "btx"
    described_as = "a BTX (btx-atoms-v1)"
    default_engine = "b12x-1.3.0"
    read_by = frozenset({B12X_130})
    writer = "trellis_cli.dialects.btx.write"
    converts_from = {DIALECT_EXL3V1: "exl3-v1-to-btx"}
    drivers = {"exl3-v1-to-btx": "trellis_cli.dialects.btx.exl3v1_btx:exl3v1_to_btx"}

    def detect(self, probe: Probe) -> DialectInfo | None:
        """BTX when btx-manifest.json carries kind btx-manifest and schema btx-atoms-v1 (one of the two: a
        manifest that claims BTX but cannot be read as it)."""
        if names.MANIFEST_FILE not in probe.files:
            return None
        doc = probe.read_json(names.MANIFEST_FILE)
        if not isinstance(doc, dict) or (doc.get("kind") != names.KIND and doc.get("schema") != names.SCHEMA):
            return None
        if doc.get("kind") != names.KIND or doc.get("schema") != names.SCHEMA:
            raise UnknownDialect(f"{names.MANIFEST_FILE}: kind {doc.get('kind')!r}, schema {doc.get('schema')!r}; "
                                 f"trellis reads kind {names.KIND!r} with schema {names.SCHEMA!r}")
        codebook = doc.get("codebook")
        # Read as exl3-v1 through the renaming table; no manifest of it is a declaration document diff compares.
        return DialectInfo(DIALECT_BTX, "n/a", 1, codebook if isinstance(codebook, str) else None,
                           Exl3v1Declarations(manifest_file=None, manifest_doc=doc))

    def fill(self, ckpt, probe: Probe, info: DialectInfo) -> bool:
        from trellis_cli.dialects.exl3v1.container import container, fill_checkpoint

        assert isinstance(info.declared, Exl3v1Declarations)
        info.declared.manifest_doc = names.manifest_as_exl3v1(info.declared.manifest_doc)
        before = len(ckpt.parse_findings)
        fill_checkpoint(ckpt, ckpt.source, probe.files, names.MANIFEST_FILE, info.declared)
        ckpt.parse_findings[before:] = [names.btx_finding(f) for f in ckpt.parse_findings[before:]]
        for layer in container(ckpt).layers.values():
            layer.tensors = {names.tensor_as_exl3v1(n): ref._replace(name=names.tensor_as_exl3v1(n))
                             for n, ref in layer.tensors.items()}
            layer.metadata = names.metadata_as_exl3v1(layer.metadata)
        if ckpt.codebook is not None:
            ckpt.codebook = names.btx_text(ckpt.codebook)
        return True

    def check(self, ckpt, request: CheckRequest, report: Report) -> None:
        """The exl3-v1 checks (the same rules in b12x 1.3.0's reader), each finding said in BTX words."""
        own = Report(subject=report.subject)
        super().check(ckpt, request, own)
        report.extend(f if f.code.startswith("btx.") else names.btx_finding(f) for f in own.findings)
        for what, n in own.checked.items():
            report.count(what, n)

    def recorded_hashes(self, ckpt, request: CheckRequest) -> list[RecordedHash]:
        return [h._replace(code="btx.sha256-mismatch", message=h.message + f" ({names.LOADER} BTX rules)")
                for h in super().recorded_hashes(ckpt, request)]

    def tp_partitions(self, ckpt, tp: int):
        """None: both planners read exl3-v1 (b12x's partition_extents is not in 1.3.0; the fork reads
        exl3-manifest.json); `repack --to exl3-v1` first."""
        return None

    def container_refusal(self, family: str) -> ContainerRefusal | None:
        if family == B12X:
            return ContainerRefusal("BTX is b12x 1.3.0's name", "a BTX checkpoint: b12x 1.5.x reads exl3-v1 only "
                                    "(exl3-manifest.json; BTX is the same container under its earlier names, read "
                                    f"by b12x 1.3.0); {RENAME}", expected="exl3-v1")
        if family == VLLM_MANIFEST:
            return ContainerRefusal("BTX is b12x 1.3.0's name", "a BTX checkpoint: this loader reads "
                                    "exl3-manifest.json through b12x 1.5.1's exl3-v1 reader; " + RENAME,
                                    expected="exl3-v1")
        if family == VLLM:
            return ContainerRefusal("wrong container", "a BTX checkpoint: BTX is b12x's container",
                                    expected="hybrid_tr3_tail or tensor_storage")
        return super().container_refusal(family)


DIALECT = BtxDialect()
