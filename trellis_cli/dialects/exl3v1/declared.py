"""What identifies an exl3-v1 container (detection); what opening keeps of it is container.py's
`Exl3v1Declarations`.

exl3-v1 is decided by the manifest's own identity strings (kind "exl3-manifest", schema "exl3-v1"), never by
the layer files' names. The manifest is the one b12x's reader opens, `exl3-manifest.json`, whatever config.json's
`quantization_config.exl3.manifest` names: a directory whose exl3-v1 manifest exists only under that other name
is still exl3-v1 (so it is refused by name, not called unknown), with no manifest to load.
"""

from __future__ import annotations

from typing import Any

from trellis_cli.checkpoint.model import DIALECT_EXL3V1
from trellis_cli.dialects.exl3v1.container import Exl3v1Declarations
from trellis_cli.dialects.interface import DialectInfo, Probe
from trellis_cli.errors import UnknownDialect
from trellis_cli.dialects.exl3v1.schema import MANIFEST_FILE
from trellis_cli.header import safe_relative

KIND, SCHEMA = "exl3-manifest", "exl3-v1"


def detect_exl3v1(probe: Probe) -> DialectInfo | None:
    """exl3-v1 when its manifest says so; UnknownDialect when the manifest claims it but cannot be read as it."""
    named = _config_manifest_name(probe.config)
    if MANIFEST_FILE not in probe.files:
        if named is None or named not in probe.files or not _is_exl3v1(probe.read_json(named)):
            return None
        return DialectInfo(DIALECT_EXL3V1, "n/a", 1, None, Exl3v1Declarations(MANIFEST_FILE, named))
    doc = probe.read_json(MANIFEST_FILE)
    if not isinstance(doc, dict) or (doc.get("kind") != KIND and doc.get("schema") != SCHEMA):
        return None
    if not _is_exl3v1(doc):
        raise UnknownDialect(f"{MANIFEST_FILE}: kind {doc.get('kind')!r}, schema {doc.get('schema')!r}; trellis "
                             f"reads kind {KIND!r} with schema {SCHEMA!r}")
    codebook = doc.get("codebook")
    return DialectInfo(DIALECT_EXL3V1, "n/a", 1, codebook if isinstance(codebook, str) else None,
                       Exl3v1Declarations(MANIFEST_FILE, named, doc))


def _is_exl3v1(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == KIND and doc.get("schema") == SCHEMA


def _config_manifest_name(config: dict[str, Any] | None) -> str | None:
    """config.json's `quantization_config.exl3.manifest` when it names a file inside the directory other than
    the reader's own name; else None."""
    quant = (config or {}).get("quantization_config")
    exl3 = quant.get("exl3") if isinstance(quant, dict) else None
    name = exl3.get("manifest") if isinstance(exl3, dict) else None
    return name if isinstance(name, str) and name != MANIFEST_FILE and safe_relative(name) else None
