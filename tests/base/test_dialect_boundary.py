"""A format's behaviour stays behind its dialect: outside `trellis_cli/dialects/`, nothing switches on how a
dialect stores its bytes or reads what only one dialect has.

Read from the source (AST), every module of the package outside dialects/ is checked for:
- a storage tag: `storage_of`, `SHARDS`, `SLOT_ROWS`, `ROUTE_PACK` or a dialect's `inspect_view` (ask the
  dialect: `Dialect.layer_units`, `layer_files`, `layer_shares`, `inspect_document`, ...);
- a dialect trait named for one dialect's metadata: `hybrid_tr3_tail`, `tensor_storage`, `r7_maps` read as an
  attribute (ask `Dialect.rank_sliced_contract`, `module_records`, `streamed_k_maps`);
- a dialect's key of the free declarations, `ckpt.declared[...]` / `.get(...)` / `in` with any key but the
  ones the shared opening writes for every dialect (SHARED_DECLARED);
- an import of one dialect's package or its modules (`trellis_cli.dialects.tr3`, `...exl3v1.container`, ...):
  the shared modules of dialects/ (interface, registry, open, detect, units, inspect_doc) are the way in.

The modules of repack/ that still do so are listed in ALLOWED, each with what it still reads; an entry that no
longer offends fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trellis_cli"
DIALECTS = PACKAGE / "dialects"
DIALECT_PACKAGES = {p.name for p in DIALECTS.iterdir() if (p / "__init__.py").is_file()}

STORAGE_TAGS = {"storage_of", "SHARDS", "SLOT_ROWS", "ROUTE_PACK", "inspect_view"}
TRAIT_NAMES = {"hybrid_tr3_tail", "tensor_storage", "r7_maps"}
# Keys dialects/open.py writes for every dialect it opens through the shared shard reader: the index's
# metadata, which geometry facts were inferred, and where each layer's declared K list came from.
SHARED_DECLARED = {"index_metadata", "inferred", "k_source"}

# Offenders left in repack/ (being restructured on its own: drivers, one staged-run skeleton); each entry says
# what the module still reads. Remove an entry once the module asks its dialect instead.
ALLOWED: dict[str, set[str]] = {
    # the exl3-v1 manifest's layer digests by storage tag (Dialect.source_digests answers it)
    "repack/source_facts.py": {"storage tag", "dialect import"},
    # the exl3-v1 drivers: the container, its packer, writer and read-backs; BTX's renaming writer; TR3's writer
    "repack/tr3_to_exl3v1.py": {"dialect import"},
    "repack/exl3v1_to_route_pack.py": {"dialect import"},
    "repack/exl3v1_btx.py": {"dialect import"},
    "repack/exl3v1_to_tr3.py": {"dialect import"},
    # the TR3 -> route pack driver: the route pack's writer, verifier and layer-file read-back
    "repack/tr3_to_route_pack.py": {"dialect import"},
    "repack/preflight.py": {"dialect import"},
    # --to tr3: TR3's writer and shard layout
    "repack/tr3_output.py": {"dialect import"},
    "repack/convert.py": {"dialect import"},
    # the GLM-5.3 stream <-> TR3 drivers: the stream's contract, rules and writer, TR3's shard writer
    "repack/glm53_stream.py": {"dialect import"},
    # Outside repack/: the R7-era loader's GLM-5.3 scope gate (architecture fields, layers, experts) is the
    # constant table the stream dialect's format rules read too; a Dialect question for it is still to come.
    "validate/engine_r7.py": {"dialect import"},
}


def _is_declared(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "declared"


def _dialect_module(name: str) -> bool:
    parts = name.split(".")
    return parts[:2] == ["trellis_cli", "dialects"] and len(parts) > 2 and parts[2] in DIALECT_PACKAGES


def offences(source: str) -> list[tuple[str, int, str]]:
    """(kind, line, what) for every crossing of the dialect boundary in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in STORAGE_TAGS:
            found.append(("storage tag", node.lineno, node.id))
        elif isinstance(node, ast.alias) and node.name in STORAGE_TAGS:
            found.append(("storage tag", 0, f"imports {node.name}"))
        elif isinstance(node, ast.Attribute) and node.attr in STORAGE_TAGS:
            found.append(("storage tag", node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Attribute) and node.attr in TRAIT_NAMES:
            found.append(("dialect trait", node.lineno, f".{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in TRAIT_NAMES):
            found.append(("dialect trait", node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
        elif isinstance(node, ast.Subscript) and _is_declared(node.value):
            key = node.slice
            if not (isinstance(key, ast.Constant) and key.value in SHARED_DECLARED):
                found.append(("declared key", node.lineno, f"declared[{ast.unparse(key)}]"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_declared(node.func.value)
              and node.func.attr in ("get", "pop", "setdefault")):
            key = node.args[0] if node.args else None
            if not (isinstance(key, ast.Constant) and key.value in SHARED_DECLARED):
                found.append(("declared key", node.lineno, f"declared.{node.func.attr}({ast.unparse(key) if key else ''})"))
        elif isinstance(node, ast.Compare) and any(_is_declared(c) for c in node.comparators):
            key = node.left
            if not (isinstance(key, ast.Constant) and key.value in SHARED_DECLARED):
                found.append(("declared key", node.lineno, f"{ast.unparse(key)} in declared"))
        elif isinstance(node, ast.Import):
            found += [("dialect import", node.lineno, a.name) for a in node.names if _dialect_module(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if _dialect_module(node.module):
                found.append(("dialect import", node.lineno, node.module))
            elif node.module == "trellis_cli.dialects":
                found += [("dialect import", node.lineno, f"{node.module}.{a.name}") for a in node.names
                          if a.name in DIALECT_PACKAGES]
    return found


def _outside_dialects() -> dict[str, list[tuple[str, int, str]]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if DIALECTS in path.parents:
            continue
        out[path.relative_to(PACKAGE).as_posix()] = offences(path.read_text(encoding="utf-8"))
    return out


def test_no_format_switch_outside_the_dialects():
    wrong = []
    for rel, found in _outside_dialects().items():
        allowed = ALLOWED.get(rel, set())
        wrong += [f"{rel}:{line}: {kind}: {what}" for kind, line, what in found if kind not in allowed]
    assert not wrong, "ask the checkpoint's dialect (dialects/interface.py) instead:\n" + "\n".join(wrong)


def test_the_allowlist_only_names_what_still_offends():
    modules = _outside_dialects()
    stale = []
    for rel, kinds in ALLOWED.items():
        assert rel in modules, f"{rel}: no such module (remove its ALLOWED entry)"
        still = {kind for kind, _, _ in modules[rel]}
        stale += [f"{rel}: {kind}" for kind in sorted(kinds - still)]
    assert not stale, "no longer offends, remove from ALLOWED:\n" + "\n".join(stale)


def test_the_guard_sees_each_form():
    sample = "\n".join([
        "from trellis_cli.dialects.registry import SLOT_ROWS, storage_of",
        "if storage_of(ck) == SLOT_ROWS: pass",
        "if dialect_of(ck).inspect_view == 'route-pack': pass",
        "if dialect.hybrid_tr3_tail or d.tensor_storage or d.r7_maps: pass",
        "getattr(d, 'r7_maps')",
        "box = ck.declared['exl3v1']",
        "m = ck.declared.get('manifest')",
        "if 'hybrid_tr3_tail' in ck.declared: pass",
        "ok = ck.declared.get('index_metadata'), ck.declared['inferred'], ck.declared.get('k_source', {})",
        "from trellis_cli.dialects.exl3v1.container import container",
        "import trellis_cli.dialects.tr3.rules",
        "from trellis_cli.dialects import routepack",
        "from trellis_cli.dialects.registry import dialect_of",
        "from trellis_cli.dialects.units import Unit",
    ])
    kinds = [kind for kind, _, _ in offences(sample)]
    assert kinds.count("storage tag") == 5  # two imported names, their two uses, .inspect_view
    assert kinds.count("dialect trait") == 4
    assert kinds.count("declared key") == 3  # the shared keys pass
    assert kinds.count("dialect import") == 3  # the shared modules of dialects/ are the way in
    assert {"btx", "exl3v1", "routepack", "tr3"} <= DIALECT_PACKAGES and "units" not in DIALECT_PACKAGES
