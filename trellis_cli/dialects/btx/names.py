"""The renaming table between BTX (`btx-atoms-v1`, b12x 1.3.0) and exl3-v1 (b12x 1.5.x): the same container
under other names. Everything else (pair-kind bytes, bundle order, rotations, rate tables, extent rules,
the parser's and reader's checks) is the same, so trellis reads a BTX checkpoint as exl3-v1 seen through
this table, and converts between the two by renaming only (the tensor bytes are never touched).

Translation is one way per call and never guesses: a name of the other spelling met where this one is
expected is marked FOREIGN, so the exl3-v1 rules refuse it as an unknown key, tensor or value (a BTX manifest
that says `slot_channels` is as wrong for b12x 1.3.0 as an unknown key), and `btx_text` turns the finding
back into BTX words.
"""

from __future__ import annotations

import re
from typing import Any

from trellis_cli.findings import Finding, Location

LOADER = "b12x 1.3.0"  # the one PyPI release that reads BTX (1.5.0 and 1.5.1 read exl3-v1 only)
SCHEMA, KIND, MANIFEST_FILE = "btx-atoms-v1", "btx-manifest", "btx-manifest.json"
EXL3V1_SCHEMA, EXL3V1_KIND, EXL3V1_MANIFEST = "exl3-v1", "exl3-manifest", "exl3-manifest.json"
LAYER_PREFIX, EXL3V1_LAYER_PREFIX = "btx-layer-", "exl3-layer-"
FOREIGN = "\u2020"  # a name of the other spelling, kept visible so the exl3-v1 rules refuse it by name

# BTX name -> exl3-v1 name, per place a name can stand.
KEYS = {  # manifest keys, by the object holding them
    "geometry": {"atom_channels": "slot_channels", "atom_slots": "num_slots"},
    "hadamard": {"coupled": "intermediate_hadamard"},
    "layout": {"atom_row_alignment": "row_alignment"},
}
TENSORS = {"atoms": "codes", "rotation_draws": "sign_pattern"}
CODEBOOKS = {"sqg_e4m3": "lut_e4m3", "sqg_fp16": "lut_fp16"}
METADATA_KEYS = {"atom_channels": "slot_channels"}
VALUES = {SCHEMA: EXL3V1_SCHEMA, KIND: EXL3V1_KIND, **CODEBOOKS}  # string values of kind, schema, codebook


def _inverse(table: dict[str, str]) -> dict[str, str]:
    return {v: k for k, v in table.items()}


def _rename(table: dict[str, str], name: str) -> str:
    """`name` in the other spelling; a name that only the other spelling has is marked FOREIGN."""
    if name in table:
        return table[name]
    return FOREIGN + name if name in _inverse(table) else name


def _value(table: dict[str, str], value: Any) -> Any:
    return _rename(table, value) if isinstance(value, str) else value


def _manifest(doc: Any, keys: dict[str, dict[str, str]], values: dict[str, str]) -> Any:
    if not isinstance(doc, dict):
        return doc
    out = dict(doc)
    for key in ("kind", "schema", "codebook"):
        if key in out:
            out[key] = _value(values, out[key])
    for section, table in keys.items():
        if isinstance(out.get(section), dict):
            out[section] = {_rename(table, k): v for k, v in out[section].items()}
    return out


def manifest_as_exl3v1(doc: Any) -> Any:
    """A btx-manifest.json document under exl3-v1 names (what the exl3-v1 parser reads)."""
    return _manifest(doc, KEYS, VALUES)


def manifest_as_btx(doc: Any) -> Any:
    """An exl3-manifest.json document under BTX names."""
    return _manifest(doc, {s: _inverse(t) for s, t in KEYS.items()}, _inverse(VALUES))


def metadata_as_exl3v1(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    return {_rename(METADATA_KEYS, k): _value(VALUES, v) if k in ("schema", "codebook") else v
            for k, v in metadata.items()}


def metadata_as_btx(metadata: dict[str, str]) -> dict[str, str]:
    """A layer file's metadata under BTX names, in the same key order (so a renamed header stays canonical)."""
    keys, values = _inverse(METADATA_KEYS), _inverse(VALUES)
    return {_rename(keys, k): _value(values, v) if k in ("schema", "codebook") else v for k, v in metadata.items()}


def tensor_as_exl3v1(name: str) -> str:
    return _rename(TENSORS, name)


def tensor_as_btx(name: str) -> str:
    return _rename(_inverse(TENSORS), name)


def layer_file_as_btx(name: str) -> str:
    """exl3-layer-NNNNN.safetensors -> btx-layer-NNNNN.safetensors; any other name is kept (the reader opens what
    the manifest says)."""
    return LAYER_PREFIX + name[len(EXL3V1_LAYER_PREFIX):] if name.startswith(EXL3V1_LAYER_PREFIX) else name


def layer_file_as_exl3v1(name: str) -> str:
    return EXL3V1_LAYER_PREFIX + name[len(LAYER_PREFIX):] if name.startswith(LAYER_PREFIX) else name


# ---- findings of the exl3-v1 rules, said in BTX words --------------------------------------------------

_WORDS = {v: k for table in (*KEYS.values(), TENSORS, CODEBOOKS, METADATA_KEYS) for k, v in table.items()}
_WORDS |= {EXL3V1_MANIFEST: MANIFEST_FILE, EXL3V1_SCHEMA: SCHEMA, EXL3V1_KIND: KIND}
_WORD = re.compile(r"(?<![\w" + FOREIGN + r"-])(" + "|".join(re.escape(w) for w in sorted(_WORDS, key=len, reverse=True))
                   + r")(?![\w-])")


def btx_text(value: Any) -> Any:
    """exl3-v1 names in a message, key path or shown value replaced by their BTX names; FOREIGN marks dropped."""
    if isinstance(value, str):
        return _WORD.sub(lambda m: _WORDS[m.group(1)], value).replace(FOREIGN, "")
    if isinstance(value, (list, tuple)):
        return type(value)(btx_text(v) for v in value)
    if isinstance(value, dict):
        return {btx_text(k): btx_text(v) for k, v in value.items()}
    return value


def btx_finding(f: Finding) -> Finding:
    """An exl3-v1 rule's finding about a BTX checkpoint: code `btx.*`, BTX names, and the loader it speaks for."""
    code = "btx." + f.code.removeprefix("exl3v1.") if f.code.startswith("exl3v1.") else f.code
    where = Location(f.where.file, f.where.layer, f.where.expert, f.where.projection, f.where.rank,
                     btx_text(f.where.tensor))
    message = btx_text(f.message)
    if code.startswith("btx."):
        message = f"{message} ({LOADER} BTX rules)"
    return Finding(code, f.severity, where, message, btx_text(f.expected), btx_text(f.found), f.engine, f.count,
                   f.summary)
