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

And one home per format: outside dialects/ no module or package is named for one dialect (repack's drivers, named
by their conversion, and the route pack's layers below the dialects excepted: BELOW_THE_DIALECTS), and the route
pack is spelled one way in module and identifier names (`route_pack`, `RoutePack`; never `repacked`, `routepack`
but as the packages' names).
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


# One home per format (docs/architecture.md): outside dialects/, no module or package is named for one dialect,
# except repack's drivers (named by their conversion, `tr3_to_exl3v1.py`) and what the kernel reads below the
# dialects: the route pack's layer layout and its packer, layer files and manifest.
BELOW_THE_DIALECTS = {"formats/route_pack.py", "routepack"}
# Spellings of the route pack other than `route_pack` / `RoutePack` / `route-pack` / `trellis-route-pack`; the one
# identifier left is the dialect's name constant, which moves with the dialects' detection (dialects/detect.py).
OTHER_SPELLINGS = ("repacked", "routepack")
SPELLED_OTHERWISE = {"DIALECT_REPACKED"}


def _named_for_a_dialect(name: str) -> bool:
    word = name.removesuffix(".py")
    return any(word.replace("_", "") == d.replace("_", "") or word.split("_")[0] == d for d in DIALECT_PACKAGES)


def test_one_home_per_format():
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE)
        if DIALECTS in path.parents or path == DIALECTS or rel.parts[0] == "repack" or "__pycache__" in rel.parts:
            continue
        if (path.suffix == ".py" or (path / "__init__.py").is_file()) and _named_for_a_dialect(path.name):
            found.append(rel.as_posix())
    assert sorted(found) == sorted(BELOW_THE_DIALECTS), "a format's modules go in its dialect's folder"


def _spelled_otherwise(name: str) -> bool:
    return any(form in name for s in OTHER_SPELLINGS for form in (s, s.upper(), s.capitalize()))


def _defined_names(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            yield node.lineno, node.attr
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.alias) and node.asname:
            yield 0, node.asname


def test_the_route_pack_is_spelled_one_way_in_code():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if _spelled_otherwise(path.stem):
            wrong.append(f"{rel}: module name")
        for line, name in _defined_names(ast.parse(path.read_text(encoding="utf-8"))):
            if _spelled_otherwise(name) and name not in SPELLED_OTHERWISE:
                wrong.append(f"{rel}:{line}: {name}")
    assert not wrong, "spell it route_pack (RoutePack):\n" + "\n".join(wrong)


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
    assert [_spelled_otherwise(n) for n in ("verify_repacked", "RoutepackDialect", "is_routepack",
                                            "Tr3ToRoutePack", "route_pack_root")] == [True, True, True, False, False]
    assert _named_for_a_dialect("exl3v1_schema.py") and _named_for_a_dialect("route_pack.py")
    assert not _named_for_a_dialect("tr3x.py") and not _named_for_a_dialect("engine_r7.py")
    assert {"btx", "exl3v1", "routepack", "tr3"} <= DIALECT_PACKAGES and "units" not in DIALECT_PACKAGES
