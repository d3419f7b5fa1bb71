"""What a command imports before it does its work: start-up is part of every command's time. Help is rendered
without pydantic (typer converts no flag's value, and every flag of the app is a plain bool), the app never
imports click itself (newer typer runs on its own copy), and a command that draws no progress bar (not on a
terminal) never imports rich.progress. Each case runs `python -m trellis_cli` in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import typer

REPO = Path(__file__).resolve().parents[2]


def imported(*args: str) -> tuple[set[str], int]:
    """Every module `trellis ARGS` imports (as `python -X importtime` lists them), and its exit code."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "trellis_cli", *args], cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120)
    modules = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return modules, done.returncode


@pytest.mark.parametrize("args", [["--help"], ["validate", "--help"], ["fit", "--help"], ["--version"]])
def test_help_imports_no_converter(args):
    modules, code = imported(*args)
    assert code == 0
    assert "pydantic" not in modules and "numpy" not in modules
    if typer.BadParameter.__module__.startswith("typer."):  # typer vendors click: nothing imports click itself
        assert "click" not in modules


def test_a_command_off_a_terminal_imports_no_progress_bars():
    modules, code = imported("validate")  # the bundled sample; stderr is a pipe here
    assert code == 0
    assert "rich.progress" not in modules and "trellis_cli.cli.progress" not in modules
