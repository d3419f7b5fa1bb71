"""A format's behaviour stays behind its dialect: outside `trellis_cli/dialects/`, nothing switches on how a
dialect stores its bytes or reads what only one dialect has.

Read from the source (AST), every module of the package outside dialects/ is checked for:
- a storage tag: `storage_of`, `SHARDS`, `SLOT_ROWS`, `ROUTE_PACK` or a dialect's `inspect_view` (ask the
  dialect: `Dialect.layer_units`, `layer_files`, `layer_shares`, `inspect_document`, ...);
- a dialect trait named for one dialect's metadata: `hybrid_tr3_tail`, `tensor_storage`, `r7_maps` read as an
  attribute (ask `Dialect.rank_sliced_contract`, `module_records`, `streamed_k_maps`);
- a dialect's declarations: `Checkpoint.declared` is the dialect's own typed object (each package's
  `declared.py`), read by its package alone: any `.declared` outside dialects/ (a key, `.get`, `in`, or a field
  of it) asks the dialect instead (`Dialect.rank_sliced_contract`, `declaration_documents`, ...); what opening
  knows for every dialect is a field of the model (`index_metadata`, `k_source`, `inferred`);
- detection: a dialect's `detect` hook or the registry's, a `Probe` or `DialectInfo` built, or a manifest's or
  contract's identity value compared (DIALECT_IDENTITIES: the schema, kind, format or scope that says which
  dialect a checkpoint is): `dialects/open.py` asks the registry, and each dialect's package decides;
- an import of one dialect's package or its modules (`trellis_cli.dialects.tr3`, `...exl3v1.container`, ...):
  the shared modules of dialects/ (interface, registry, open, units, inspect_doc, conversion, source_facts,
  shard_pack, tp_reslice, carry) are the way in.

No module is excepted: a conversion's driver lives in its dialect's package (the registry's `drivers`), and a
loader version's gate on one dialect's scope is a Dialect question (`scope_declared`, `scope_refusals`).

And one home per format: outside dialects/ no module or package is named for one dialect, and the route pack is
spelled one way in module and identifier names (`route_pack`, `RoutePack`; never `repacked`, `routepack` but as
the package's name).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trellis_cli"
DIALECTS = PACKAGE / "dialects"
DIALECT_PACKAGES = {p.name for p in DIALECTS.iterdir() if (p / "__init__.py").is_file()}

STORAGE_TAGS = {"storage_of", "SHARDS", "SLOT_ROWS", "ROUTE_PACK", "inspect_view"}
TRAIT_NAMES = {"hybrid_tr3_tail", "tensor_storage", "r7_maps"}
# The detection machinery: the hooks, the registry's walks and what they take and give.
DETECTION_NAMES = {"detect", "detect_from_listing", "Probe", "DialectInfo"}
# The values that say which dialect a checkpoint is (a manifest's schema or kind, the TR3 contract's format, the
# quantization block's method or scope): compared only by the dialect that owns them.
DIALECT_IDENTITIES = {"trellis-route-pack", "exl3-manifest", "btx-manifest", "btx-atoms-v1", "exl3-trellis",
                      "b12x_trellis", "glm53_routed_experts_only"}

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
        elif isinstance(node, ast.Attribute) and node.attr == "declared":
            found.append(("declared key", node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr in DETECTION_NAMES:
            found.append(("detection", node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Name) and node.id in DETECTION_NAMES:
            found.append(("detection", node.lineno, node.id))
        elif isinstance(node, ast.alias) and node.name in DETECTION_NAMES:
            found.append(("detection", 0, f"imports {node.name}"))
        elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value in DIALECT_IDENTITIES for c in (node.left, *node.comparators)):
            found.append(("detection", node.lineno, ast.unparse(node)))
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
        wrong += [f"{rel}:{line}: {kind}: {what}" for kind, line, what in found]
    assert not wrong, "ask the checkpoint's dialect (dialects/interface.py) instead:\n" + "\n".join(wrong)


# One home per format (docs/architecture.md): outside dialects/, no module or package is named for one dialect.
# What the kernel reads below the dialects is the LayerPack (formats/layer_pack.py), which every packer makes.
# Spellings of the route pack other than `route_pack` / `RoutePack` / `route-pack` / `trellis-route-pack` (none
# left: the dialect's name constant is `DIALECT_ROUTE_PACK`).
OTHER_SPELLINGS = ("repacked", "routepack")
SPELLED_OTHERWISE: set[str] = set()


def _named_for_a_dialect(name: str) -> bool:
    word = name.removesuffix(".py")
    return any(word.replace("_", "") == d.replace("_", "") or word.split("_")[0] == d for d in DIALECT_PACKAGES)


def test_one_home_per_format():
    found = []
    for path in sorted(PACKAGE.rglob("*")):
        rel = path.relative_to(PACKAGE)
        if DIALECTS in path.parents or path == DIALECTS or "__pycache__" in rel.parts:
            continue
        if (path.suffix == ".py" or (path / "__init__.py").is_file()) and _named_for_a_dialect(path.name):
            found.append(rel.as_posix())
    assert not found, "a format's modules go in its dialect's folder: " + ", ".join(found)


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
        "hybrid = ck.declared.hybrid",
        "ok = ck.index_metadata, ck.inferred, ck.k_source",
        "from trellis_cli.dialects.registry import detect",
        "info = registry.detect(Probe(files, config, None, read))",
        "if doc.get('schema') == 'trellis-route-pack' or 'exl3-manifest' != doc['kind']: pass",
        "if q.get('quant_method') == 'exl3': pass",
        "from trellis_cli.dialects.exl3v1.container import container",
        "import trellis_cli.dialects.tr3.rules",
        "from trellis_cli.dialects import routepack",
        "from trellis_cli.dialects.registry import dialect_of",
        "from trellis_cli.dialects.units import Unit",
    ])
    kinds = [kind for kind, _, _ in offences(sample)]
    assert kinds.count("storage tag") == 5  # two imported names, their two uses, .inspect_view
    assert kinds.count("dialect trait") == 4
    assert kinds.count("declared key") == 4  # the model's own fields pass
    assert kinds.count("detection") == 5  # the import, the hook, the Probe, two comparisons; an engine's own
    # reading of quant_method passes
    assert kinds.count("dialect import") == 3  # the shared modules of dialects/ are the way in
    assert [_spelled_otherwise(n) for n in ("verify_repacked", "RoutepackDialect", "is_routepack",
                                            "Tr3ToRoutePack", "route_pack_root")] == [True, True, True, False, False]
    assert _named_for_a_dialect("exl3v1_schema.py") and _named_for_a_dialect("route_pack.py")
    assert not _named_for_a_dialect("layer_pack.py")
    assert not _named_for_a_dialect("tr3x.py") and not _named_for_a_dialect("engine_r7.py")
    assert {"btx", "exl3v1", "routepack", "tr3"} <= DIALECT_PACKAGES and "units" not in DIALECT_PACKAGES


def test_the_footprint_script_names_the_files_a_change_touched_outside_the_dialects():
    """tools/dialect_footprint.py (docs/architecture.md, "Adding a dialect"): what a new dialect or conversion
    touched outside trellis_cli/dialects/, tests/ and docs/, which should be nothing."""
    import importlib.util

    path = PACKAGE.parent / "tools" / "dialect_footprint.py"
    spec = importlib.util.spec_from_file_location("dialect_footprint", path)
    assert spec is not None and spec.loader is not None
    footprint = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(footprint)
    touched = ["trellis_cli/dialects/newfmt/__init__.py", "trellis_cli/dialects/registry.py", "tests/dialects/x.py",
               "docs/checkpoint-dialects.md", "trellis_cli/repack/drivers.py", "trellis_cli/checkpoint/model.py"]
    assert footprint.outside(touched) == ["trellis_cli/checkpoint/model.py", "trellis_cli/repack/drivers.py"]
