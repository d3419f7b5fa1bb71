"""The conventions every command keeps: one-line parser errors, global flags anywhere, usage and source
errors before slow work or the GPU, one meaning for a selection that matches nothing, Ctrl-C."""

from __future__ import annotations

import dataclasses
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


# ---- validate's totals -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def zeros(tmp_path_factory) -> Path:
    """The tiny checkpoint with every data byte zero (sparse): hundreds of data findings under --deep."""
    spec = dataclasses.replace(synth.preset("tiny"), sparse=True)
    return synth.write_checkpoint(tmp_path_factory.mktemp("zeros") / "z", spec)


def test_validate_totals_are_true_in_json_and_text(capsys, zeros):
    code, out, _ = run_cli(capsys, "validate", str(zeros), "--deep", "--json")
    doc = json.loads(out)
    assert code == 1
    counts = doc["counts"]
    listed = {}
    for f in doc["findings"]:
        assert f["location"], f  # no stand-in finding with an empty location
        listed[f["code"]] = listed.get(f["code"], 0) + f.get("count", 1)
    omitted = {o["code"]: o["count"] for o in doc["omitted"]}
    assert omitted["data.zero-vector"] > 0
    for code_name, per in counts["by_code"].items():
        assert sum(per.values()) == listed.get(code_name, 0) + omitted.get(code_name, 0)
    assert counts["error"] == sum(per.get("error", 0) for per in counts["by_code"].values())
    # 8 experts x 3 projections x 2 ranks x 2 layers, suh and svh each: all zero.
    assert counts["by_code"]["data.zero-vector"] == {"error": 192}

    code, out, err = run_cli(capsys, "validate", str(zeros), "--deep")
    assert code == 1
    assert f"FAIL: local directory {zeros}: {counts['error']} error(s), {counts['warning']} warning(s)" in out
    more = [line for line in out.splitlines() if "more data.zero-vector" in line]
    assert more == [f"error[data.zero-vector] ... and {omitted['data.zero-vector']} more data.zero-vector "
                    "finding(s) not listed (192 in all)"]


def test_a_finding_without_expected_does_not_say_none(capsys, zeros):
    _, out, _ = run_cli(capsys, "validate", str(zeros), "--deep")
    assert "expected None" not in out and "(found 0)" in out


# ---- selections that name what is not there ----------------------------------------------------------

@pytest.mark.parametrize("command", ["validate", "inspect", "repack"])
@pytest.mark.parametrize("layers", ["99", "4,99", "50-60"])
def test_a_selection_naming_missing_layers_is_a_usage_error(capsys, source, tmp_path, command, layers):
    argv = [command, str(source)] + ([str(tmp_path / "o")] if command == "repack" else [])
    code, out, err = run_cli(capsys, *argv, "--layers", layers, "--json")
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("error: --layers: [") and "not in the source (it has 3-4)" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_checksums_with_nothing_to_compare_do_not_pass(capsys, tmp_path, source):
    root = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(source), str(root)], check=True)
    (root / "MANIFEST.sha256").unlink()
    code, out, err = run_cli(capsys, "validate", str(root), "--checksums")
    assert code == 1 and "PASS" not in out
    assert "error[checksum.unavailable]" in out and "no file was checked" in out and "0 checksums" in out
    code, out, _ = run_cli(capsys, "validate", str(source), "--checksums")
    assert code == 0 and "PASS" in out and "5 checksums" in out


def test_a_header_only_verdict_says_data_was_not_checked(capsys, zeros):
    code, out, _ = run_cli(capsys, "validate", str(zeros))
    assert code == 0 and "PASS" in out and "tensor data not checked (headers only; --deep reads it)" in out
    code, out, _ = run_cli(capsys, "validate", str(zeros), "--json")
    assert json.loads(out)["notes"] == ["tensor data not checked (headers only; --deep reads it)"]


# ---- repack: usage errors first, and what "verified" means -------------------------------------------

@pytest.mark.parametrize("extra, part", [
    (["--tp", "0"], "--tp 0: must be at least 1"),
    (["--jobs", "0"], "--jobs 0: must be at least 1"),
    (["--layers", ""], "--layers is empty"),
])
def test_repack_usage_errors_come_before_opening_the_source(capsys, tmp_path, extra, part):
    unreadable = tmp_path / "src"  # opening it would fail with exit 1 (config.json is not JSON)
    unreadable.mkdir()
    (unreadable / "config.json").write_text("{not json")
    code, out, err = run_cli(capsys, "repack", str(unreadable), str(tmp_path / "o"), *extra)
    assert code == 2 and out == "" and "opening" not in err
    assert_one_error_line(err, part)
    code, _, err = run_cli(capsys, "repack", str(unreadable), str(unreadable / "o"))
    assert code == 2 and "refusing to write into the source" in err and "opening" not in err


def test_repack_and_its_validation_say_tensor_values_were_not_checked(capsys, zeros, tmp_path):
    out_dir = tmp_path / "packed"
    code, out, err = run_cli(capsys, "repack", str(zeros), str(out_dir))
    assert code == 0 and "written and verified against the source bit for bit" in out
    assert f"tensor values not checked (`trellis validate {zeros} --deep` checks them)" in out
    assert f"opening local directory {zeros}: reading headers and validating" in err  # stderr is not a terminal
    seconds = float(out.split(" bytes in ")[1].split(" s ")[0])
    assert seconds > 0 and "s of it opening, validating and planning" in out

    code, out, _ = run_cli(capsys, "validate", str(out_dir))
    assert code == 0 and "PASS" in out and "tensor values not checked" in out

    code, out, _ = run_cli(capsys, "repack", str(zeros), str(tmp_path / "again"), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["seconds"] >= doc["write_seconds"] > 0 and "tensor values not checked" in doc["notes"][0]
