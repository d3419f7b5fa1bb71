"""Exit codes and hints come from one table (cli/exit_codes.py): the `error:` line first, then at most one
`hint:` line naming the command that ran; library modules never decide exit codes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import error_line, run_cli, tiny_checkpoint
from trellis_cli.cli import output
from trellis_cli.cli.exit_codes import EXIT_CODES, exit_code, hint
from trellis_cli.errors import (EXIT_FINDINGS, EXIT_GPU, EXIT_SOURCE, EXIT_USAGE, CheckFailed, GpuUnavailable,
                                SourceUnavailable, UnknownDialect, UsageError)

PACKAGE = Path(__file__).resolve().parents[2] / "trellis_cli"


@pytest.fixture(autouse=True)
def _fresh_flags(monkeypatch):
    monkeypatch.setattr(output.state, "debug", False)
    monkeypatch.setattr(output.state, "quiet", False)


def test_the_table_gives_code_and_hint_by_type_subclasses_first():
    assert exit_code(UsageError("x")) == EXIT_USAGE and hint(UsageError("x"), "trellis fit") == "see `trellis fit --help`"
    assert exit_code(SourceUnavailable("x")) == EXIT_SOURCE and "--offline" in (hint(SourceUnavailable("x")) or "")
    gpu = hint(GpuUnavailable("x")) or ""
    assert exit_code(GpuUnavailable("x")) == EXIT_GPU and "--plan" in gpu and "--compile-only" in gpu
    assert exit_code(UnknownDialect("x")) == EXIT_FINDINGS and hint(UnknownDialect("x")) is None
    assert exit_code(CheckFailed("x")) == EXIT_FINDINGS and exit_code(PermissionError(13, "denied")) == EXIT_FINDINGS
    assert exit_code(RuntimeError("bug")) == EXIT_FINDINGS and hint(RuntimeError("bug")) is None
    kinds = [row.kind for row in EXIT_CODES]
    for i, kind in enumerate(kinds):  # a row below its own base class would never match
        assert not any(issubclass(kind, earlier) for earlier in kinds[:i]), kind


def test_a_usage_error_ends_with_the_hint_of_its_command(capsys):
    code, out, err = run_cli(capsys, "inspect", "--json", "--markdown")
    lines = err.strip().splitlines()
    assert code == 2 and out == ""
    assert lines == ["error: --json and --markdown are exclusive: choose one output format",
                     "hint: see `trellis inspect --help`"], lines


def test_a_missing_source_gets_the_source_hint_after_its_error(tmp_path, capsys):
    code, _, err = run_cli(capsys, "-q", "validate", str(tmp_path / "absent"))
    lines = err.strip().splitlines()
    assert code == 3 and lines[-2] == error_line(err) and str(tmp_path / "absent") in lines[-2]
    assert lines[-1].startswith("hint: check the path, or the repo id") and err.count("hint:") == 1


def test_a_failed_check_has_no_hint(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path)
    (root / "config.json").write_text("{")
    code, _, err = run_cli(capsys, "-q", "inspect", str(root))
    assert code == 1 and error_line(err) and "hint:" not in err, err


def test_no_library_module_imports_exit_codes():
    """Library exceptions carry meaning; only the CLI layer maps them to what the shell sees."""
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "cli" or path.name == "errors.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or "", *(alias.name for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            assert not any("exit_codes" in n or n.startswith("EXIT_") for n in names), (path, names)
