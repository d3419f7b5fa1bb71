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

from helpers import run_cli, error_line, without_hint
from trellis_cli import synth
from trellis_cli.cli import output

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_flags(monkeypatch):
    monkeypatch.setattr(output.state, "debug", False)
    monkeypatch.setattr(output.state, "quiet", False)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("conv") / "src", synth.preset("tiny"))


def assert_one_error_line(err: str, *parts: str) -> None:
    assert len(without_hint(err).splitlines()) == 1 and err.startswith("error: "), err
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


def _commands() -> list[str]:
    from trellis_cli.cli.app import build_command

    return sorted(build_command().commands)


@pytest.mark.parametrize("command", _commands())
def test_every_usage_line_names_its_arguments_plainly(capsys, command):
    """`trellis repack [OPTIONS] SOURCE OUT`: NAME when required, [NAME] when optional, never `{NAME}`."""
    from trellis_cli.cli.app import build_command

    arguments = [p for p in build_command().commands[command].params if p.param_type_name == "argument"]
    expected = " ".join(p.name.upper() if p.required else f"[{p.name.upper()}]" for p in arguments)
    code, out, _ = run_cli(capsys, command, "--help")
    usage = next(line.strip() for line in out.splitlines() if "Usage:" in line)
    assert code == 0 and arguments
    assert usage == f"Usage: trellis {command} [OPTIONS] {expected}", usage
    assert "{" not in usage and "}" not in usage


def test_usage_lines_of_the_commands_with_required_arguments(capsys):
    for command, usage in [("repack", "SOURCE OUT"), ("diff", "A B"), ("synth", "OUT"), ("inspect", "[SOURCE]")]:
        out = run_cli(capsys, command, "--help")[1]
        assert f"Usage: trellis {command} [OPTIONS] {usage}" in out, out


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
    assert "omitted" not in doc  # the JSON document lists every finding: nothing is left out
    for code_name, per in counts["by_code"].items():
        assert sum(per.values()) == listed.get(code_name, 0)
    assert counts["error"] == sum(per.get("error", 0) for per in counts["by_code"].values())
    # 8 experts x 3 projections x 2 ranks x 2 layers, suh and svh each: all zero.
    assert counts["by_code"]["data.zero-vector"] == {"error": 192}

    code, out, err = run_cli(capsys, "validate", str(zeros), "--deep")
    assert code == 1
    assert f"FAIL: local directory {zeros}: {counts['error']} error(s), {counts['warning']} warning(s)" in out
    more = [line for line in out.splitlines() if "more data.zero-vector" in line]
    shown = sum(1 for line in out.splitlines() if line.startswith("error[data.zero-vector] "))
    assert more == [f"error[data.zero-vector] ... and {192 - shown + 1} more data.zero-vector "
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
    assert error_line(err).startswith("error: --layers: [") and "not in the source (it has 3-4)" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_checksums_with_nothing_to_compare_do_not_pass(capsys, tmp_path, source):
    root = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(source), str(root)], check=True)
    (root / "MANIFEST.sha256").unlink()
    code, out, err = run_cli(capsys, "validate", str(root), "--checksums")
    assert code == 1 and "PASS" not in out
    assert "error[checksum.unavailable]" in out and "no file was checked" in out and "0 checksums" in out
    code, out, _ = run_cli(capsys, "validate", str(source), "--checksums")
    assert code == 0 and "PASS" in out and "6 checksums" in out


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


# ---- a stalled Hub, and Ctrl-C -----------------------------------------------------------------------

@pytest.fixture
def silent_server():
    """Accepts every connection and never answers."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list = []

    def accept() -> None:
        try:
            while True:
                held.append(listener.accept()[0])
        except OSError:  # closed at teardown
            pass

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", held
    listener.close()
    for connection in held:
        connection.close()


def trellis_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(PYTHONPATH=str(REPO), HF_HUB_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "home"),
               HF_HUB_DISABLE_PROGRESS_BARS="1", **extra)
    return env


def test_a_hub_that_never_answers_is_exit_3_not_a_hang(tmp_path, silent_server):
    endpoint, _ = silent_server
    env = trellis_env(tmp_path, HF_HUB_ETAG_TIMEOUT="1", HF_HUB_DOWNLOAD_TIMEOUT="1")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "trellis_cli", "inspect", "org/model", "--endpoint",
                             endpoint], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3 and result.stdout == "" and time.monotonic() - started < 30
    last = error_line(result.stderr)
    assert last.startswith("error: org/model") and "org/model@main: " in last and "did not answer in time" in last
    assert "HF_HUB_DOWNLOAD_TIMEOUT" in last and "Traceback" not in result.stderr


@pytest.mark.slow  # about 35 s: the library retries a timed-out file request with backoff before giving up
def test_a_hub_that_stalls_on_header_reads_is_exit_3(tmp_path, source):
    from hub_server import HubServer

    env = trellis_env(tmp_path, HF_HUB_ETAG_TIMEOUT="1", HF_HUB_DOWNLOAD_TIMEOUT="1")
    with HubServer() as hub:
        hub.add_commit("org/model", source)
        hub.stall = lambda path: "/resolve/" in path or "/lfs-blobs/" in path  # the API answers; files never
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "trellis_cli", "inspect", "org/model", "--endpoint",
                                 hub.endpoint], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 3 and result.stdout == "" and time.monotonic() - started < 45, result.stderr
    assert error_line(result.stderr).startswith("error: config.json in org/model@")
    assert "did not answer in time" in result.stderr and "thrown while requesting" not in result.stderr


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, silent_server):
    endpoint, connections = silent_server
    env = trellis_env(tmp_path)  # default limits: still waiting when the signal comes
    # A test run started in the background of a non-interactive shell ignores SIGINT, and children inherit
    # that; the command under test gets the disposition of one started from a terminal.
    process = subprocess.Popen([sys.executable, "-m", "trellis_cli", "inspect", "org/model", "--endpoint",
                                endpoint], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 30
    while not connections and time.monotonic() < deadline:  # wait until it is waiting on the server
        time.sleep(0.05)
    time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 130 and out == "", err
    assert err.splitlines()[-1] == "interrupted (Ctrl-C)" and "Traceback" not in err


# ---- inspect: route packs in TR3 terms, totals, progress ---------------------------------------------

def test_route_pack_inspect_uses_the_tr3_notation_and_keys(capsys, source, tmp_path):
    packed = tmp_path / "packed"
    assert run_cli(capsys, "repack", str(source), str(packed))[0] == 0
    code, out, _ = run_cli(capsys, "inspect", str(packed))
    assert code == 0 and "{" not in out and "K3x" not in out
    assert "geometry: hidden 256, intermediate 256 (128 per rank), 8 experts per layer" in out
    code, tr3_out, _ = run_cli(capsys, "inspect", str(source))
    for layer_line in (line for line in tr3_out.splitlines() if line.startswith("layer ")):
        assert layer_line.split(", ")[0].split(" (")[0] in out  # "layer 3: 6/2"
    code, out, _ = run_cli(capsys, "inspect", str(packed), "--json")
    pack = json.loads(out)["route_pack"]
    _, tr3_json, _ = run_cli(capsys, "inspect", str(source), "--json")
    tr3 = json.loads(tr3_json)
    assert set(pack["geometry"]) == set(tr3["geometry"]) and pack["geometry"]["intermediate_per_rank"] == 128
    assert "intermediate_rank" not in json.dumps(pack)
    tr3_row = next(r for r in tr3["layers"] if r["layer"] == 3)
    pack_row = next(r for r in pack["layers"] if r["layer"] == 3)
    assert {k: pack_row[k] for k in ("partition", "k_values", "tiers", "bpw")} == \
        {k: tr3_row[k] for k in ("partition", "k_values", "tiers", "bpw")}


def test_inspect_totals_are_the_whole_checkpoint_and_the_selection_is_separate(capsys, source):
    _, everything, _ = run_cli(capsys, "inspect", str(source), "--json")
    _, selected, _ = run_cli(capsys, "inspect", str(source), "--layers", "4", "--json")
    whole, part = json.loads(everything), json.loads(selected)
    assert part["totals"] == whole["totals"] and whole["totals"]["layers"] == 2
    row4 = next(r for r in whole["layers"] if r["layer"] == 4)
    assert part["selection"] == {"layers": "4", "routed_bytes_per_rank": row4["bytes_per_rank"],
                                 "routed_trellis_bytes_per_rank": row4["trellis_bytes_per_rank"]}
    _, text, _ = run_cli(capsys, "inspect", str(source), "--layers", "4")
    assert "selected layers 4: routed experts per rank" in text and "totals (whole checkpoint): 2 MoE layers" in text


def test_inspect_shows_progress_on_a_terminal(capsys, source, terminal):
    code, out, _ = run_cli(capsys, "inspect", str(source))
    assert code == 0 and "totals (whole checkpoint)" in out
    assert f"reading headers of local directory {source}" in terminal.getvalue() and "0:00:0" in terminal.getvalue()


def test_the_checksum_bar_has_human_units_and_a_total(capsys, source, terminal):
    code, out, _ = run_cli(capsys, "validate", str(source), "--checksums")
    assert code == 0 and "6 checksums" in out
    drawn = terminal.getvalue()
    assert "/7.1 MB" in drawn  # the checkpoint's files (its experts and its other weights), in human units
