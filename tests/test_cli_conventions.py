"""The conventions every command keeps: one-line parser errors, global flags anywhere, usage and source
errors before slow work or the GPU, one meaning for a selection that matches nothing, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_repack_cli import run_cli
from trellis_cli import synth
from trellis_cli.cli import output

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_flags(monkeypatch):
    monkeypatch.setattr(output.state, "debug", False)
    monkeypatch.setattr(output.state, "quiet", False)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("conv") / "src", synth.preset("tiny"))


def assert_one_error_line(err: str, *parts: str) -> None:
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "╭" not in err and "Usage:" not in err
    for part in parts:
        assert part in err, err


# ---- the argument parser -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, parts", [
    (["inspect", "--bogus"], ["trellis inspect", "No such option: --bogus", "trellis inspect --help"]),
    (["bench", "--replays", "10"], ["trellis bench", "--replays", "100"]),
    (["synth", "OUT", "--preset", "nosuch"], ["trellis synth", "--preset", "nosuch"]),
    (["repack"], ["trellis repack", "Missing argument"]),
    (["nosuch"], ["No such command 'nosuch'"]),
])
def test_parser_errors_are_one_line(capsys, argv, parts):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert_one_error_line(err, *parts)


def test_help_still_works(capsys):
    code, out, _ = run_cli(capsys, "inspect", "--help")
    assert code == 0 and "--layers" in out


@pytest.mark.parametrize("flag", ["-q", "--quiet"])
def test_quiet_after_the_subcommand(capsys, flag):
    code, out, err = run_cli(capsys, "validate", flag)
    assert code == 0 and "PASS" in out and err == ""  # no "reading ..." log line
    code, out, err = run_cli(capsys, "validate")
    assert code == 0 and "reading" in err


def test_debug_after_the_subcommand(capsys, tmp_path):
    code, _, err = run_cli(capsys, "validate", str(tmp_path / "nope"), "--debug")
    assert code == 3 and err.startswith("error: ") and "Traceback" in err


def test_an_option_value_is_not_taken_for_a_global_flag(capsys):
    from trellis_cli.cli.app import hoist_global_flags

    assert hoist_global_flags(["validate", "--token", "-q", "-q"]) == ["-q", "validate", "--token", "-q"]
    assert hoist_global_flags(["repack", "a", "b", "--", "-q"]) == ["repack", "a", "b", "--", "-q"]
    assert hoist_global_flags(["--debug", "inspect", "--json", "--debug"]) == [
        "--debug", "--debug", "inspect", "--json"]


# ---- bench: arguments before the GPU -----------------------------------------------------------------

@pytest.mark.parametrize("argv, expected, part", [
    (["bench"], 2, "nothing to benchmark"),
    (["bench", "--synthetic", "nosuch"], 2, "unknown synthetic preset 'nosuch'"),
    (["bench", "--synthetic", "glm52-tp4", "--partition", "1/2"], 2, "must add up"),
    (["bench", "--synthetic", "glm52-tp4", "--partition", "x"], 2, "--partition"),
    (["bench", "./nonexistent"], 3, "no such file or directory"),
    (["bench", "--compile-only", "--arch", "banana"], 2, "--arch 'banana'"),
    (["bench", "--arch", "banana"], 2, "--arch applies to --compile-only"),
])
def test_bench_checks_its_arguments_before_the_gpu(capsys, monkeypatch, tmp_path, argv, expected, part):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, *argv)
    assert code == expected and out == ""
    assert_one_error_line(err, part)
