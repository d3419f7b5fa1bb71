"""The layers of docs/architecture.md, enforced on the import graph read from the source (AST).

Every `import` and `from ... import` counts, at module level or inside a function: a function-level import is
still a dependency. Checked: no cycle between modules, no cycle between packages, no import that points up a
layer or sideways between the work packages except the sibling edges listed below, nothing imports the CLI.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "trellis_cli"
ROOT = "trellis_cli"

# Bottom first. A module's layer is that of its longest listed prefix (relative to trellis_cli); "" is the
# package's own __init__ (the library API), on top with the CLI.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "findings", "codebooks", "id_ranges", "header", "header_layout", "header_records", "stwriter",
              "disk_space", "formats")),
    ("sources", ("sources", "hub_client", "integrity", "selection", "sample")),
    ("model", ("checkpoint", "codec", "encoder", "reference", "synth")),
    ("dialects", ("dialects",)),
    ("work", ("validate", "repack", "bench", "kernel", "inspect_report", "inspect_tensors", "inspect_tp", "diff",
              "fit")),
    ("entry", ("workflows", "inspect_request")),
    ("top", ("cli", "__main__", "")),
]
# The work packages are siblings: one never imports another, except along these edges.
SIBLINGS = {"validate": "validate", "repack": "repack", "bench": "bench", "kernel": "kernel",
            "inspect_report": "inspect", "inspect_tensors": "inspect", "inspect_tp": "inspect", "diff": "diff",
            "fit": "fit"}
ALLOWED_SIBLING_EDGES = {
    ("bench", "kernel"),  # bench runs the fused kernel
}
# `from trellis_cli import __version__`: the root package's one constant, defined before anything else there.
VERSION_IMPORT = (ROOT, "__version__")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(_resolve(a.name) for a in node.names if a.name.split(".")[0] == ROOT)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            if base.split(".")[0] != ROOT:
                continue
            for alias in node.names:
                if (base, alias.name) == VERSION_IMPORT:
                    continue
                full = f"{base}.{alias.name}"
                out.add(full if full in MODULES else _resolve(base))
    out.discard(None)
    out.discard(module)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _relative(module: str) -> str:
    return module[len(ROOT) + 1:] if module != ROOT else ""


def _layer(module: str) -> tuple[int, str]:
    name, best = _relative(module), None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or (prefix and name.startswith(prefix + ".")):
                if best is None or len(prefix) > len(best[1]):
                    best = (index, prefix)
    assert best is not None, f"{module} is in no layer of docs/architecture.md: add it to LAYERS and the drawing"
    return best


def _package(module: str) -> str:
    """The package-level node: a subpackage of trellis_cli, or a top-level module."""
    return _relative(module).split(".")[0]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_graph_is_read():
    assert "trellis_cli.kernel.plan" in GRAPH and "trellis_cli.errors" in GRAPH["trellis_cli.kernel.plan"]
    # a function-level import is an edge too
    assert "trellis_cli.validate" in GRAPH["trellis_cli.workflows"]


def test_no_cycle_between_modules():
    cycles = _cycles(GRAPH)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_no_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        packages.setdefault(_package(module), set()).update(_package(t) for t in targets if _package(t) !=
                                                            _package(module))
    cycles = _cycles(packages)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_every_import_follows_the_layers():
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        (layer, prefix) = _layer(module)
        for target in sorted(targets):
            (target_layer, target_prefix) = _layer(target)
            if target_layer > layer:
                wrong.append(f"{module} -> {target}: up from {LAYERS[layer][0]} to {LAYERS[target_layer][0]}")
            elif (target_layer == layer and prefix in SIBLINGS and target_prefix in SIBLINGS
                  and SIBLINGS[prefix] != SIBLINGS[target_prefix]
                  and (SIBLINGS[prefix], SIBLINGS[target_prefix]) not in ALLOWED_SIBLING_EDGES):
                wrong.append(f"{module} -> {target}: between sibling work packages")
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_cli():
    importers = [m for m, targets in GRAPH.items() if any(_package(t) == "cli" for t in targets)
                 and _package(m) not in ("cli", "__main__")]
    assert not importers, importers


def test_formats_are_torch_free_and_import_only_the_base():
    for module, targets in GRAPH.items():
        if _package(module) == "formats":
            assert all(_layer(t)[0] == 0 for t in targets), module
    names = sorted(m for m in MODULES if _package(m) == "formats")
    code = (f"import sys; import {', '.join(names)}; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    assert _run(code) == "[]"


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return done.stdout.strip()


@pytest.mark.parametrize("module", ["trellis_cli.kernel.plan", "trellis_cli.formats.layer_pack"])
def test_the_kernel_plan_loads_no_validate_repack_or_sources_module(module):
    code = (f"import sys; import {module}; "
            "print(sorted(m for m in sys.modules if m.startswith(('trellis_cli.validate', 'trellis_cli.repack', "
            "'trellis_cli.sources', 'trellis_cli.checkpoint', 'trellis_cli.integrity'))))")
    assert _run(code) == "[]"


# ---- finding codes are data ----------------------------------------------------------------------------

TEXT_TESTS = ("startswith", "endswith", "find", "index", "count", "rfind")
MESSAGE_NAMES = {"message", "msg", "detail", "reason", "text"}


def _exception_names(tree: ast.AST) -> set[str]:
    return {h.name for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler) and h.name}


def _is_text_of(node: ast.AST, caught: set[str], names: set[str]) -> bool:
    """`str(e)` / `e.args` of a caught exception `e`, or a variable in `names`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str" and node.args:
        arg = node.args[0]
        return isinstance(arg, ast.Name) and arg.id in caught
    if isinstance(node, ast.Attribute) and node.attr == "args":
        return isinstance(node.value, ast.Name) and node.value.id in caught
    return isinstance(node, ast.Name) and node.id in names


def _reads_text(node: ast.AST, caught: set[str], names: set[str] = frozenset()) -> bool:
    """Whether `node` holds a test (`in`, `==`, `.startswith`, ...) on an exception's text or such a name."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn, ast.Eq, ast.NotEq))
                                                for op in sub.ops):
            if any(_is_text_of(side, caught, names) for side in (sub.left, *sub.comparators)):
                return True
        if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in TEXT_TESTS
                and _is_text_of(sub.func.value, caught, names)):
            return True
    return False


def _code_values(tree: ast.AST):
    """Every expression that becomes a finding code: `code = ...`, `code=...`, a Finding's or error()'s first
    argument."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "code" for t in node.targets):
            yield node, node.value
        elif isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "code":
                    yield node, kw.value
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name in ("error", "warning", "info", "Finding", "error_summary") and node.args:
                yield node, node.args[0]


def test_no_finding_code_is_derived_from_message_text():
    wrong = []
    for module, path in sorted(MODULES.items()):
        where = path.relative_to(PACKAGE.parent)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        caught = _exception_names(tree)
        for node in ast.walk(tree):  # an exception's text is never tested, whatever the test feeds
            if isinstance(node, ast.Compare) and _reads_text(node, caught):
                wrong.append(f"{where}:{node.lineno}: tests an exception's text")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in TEXT_TESTS and _is_text_of(node.func.value, caught, set())):
                wrong.append(f"{where}:{node.lineno}: tests an exception's text")
        for node, value in _code_values(tree):  # nor is a code chosen by testing a message
            if _reads_text(value, caught, MESSAGE_NAMES):
                wrong.append(f"{where}:{node.lineno}: a finding code read from message text")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_message_text_check_sees_the_old_forms():
    old = ast.parse('try:\n    pass\nexcept E as e:\n    code = "json.too-large" if "limit" in str(e) else "x"\n'
                    'code = "a" if detail.startswith("cannot read") else "b"\n')
    caught = _exception_names(old)
    assert [_reads_text(value, caught, MESSAGE_NAMES) for _, value in _code_values(old)] == [True, True]


def test_tests_run_the_cli_through_the_one_runner():
    """Every test that runs the CLI in process goes through tests/helpers.py's run_cli (exit code and output
    captured one way), and the tests are laid out by the package they cover (tests/<package>/test_*.py)."""
    tests = Path(__file__).resolve().parents[1]
    direct_import = "from trellis_cli.cli.app " + "import main"  # split: this file is scanned too
    direct = [str(p.relative_to(tests)) for p in sorted(tests.rglob("test_*.py"))
              if direct_import in p.read_text(encoding="utf-8")]
    assert not direct, direct
    loose = [p.name for p in tests.glob("test_*.py")]
    assert not loose, f"test files belong in a folder of the package they cover: {loose}"


def test_the_tests_have_one_conftest():
    """Test modules import shared helpers with `from conftest import ...`; a second conftest.py in a folder
    without __init__.py takes that name first and breaks collection of every module that imports it."""
    tests = Path(__file__).resolve().parents[1]
    assert [str(p.relative_to(tests)) for p in sorted(tests.rglob("conftest.py"))] == ["conftest.py"]
