"""Hostile input on the command line: names that try to drive the terminal, system errors, absurd ranges.

Each case runs the real CLI and checks the contract: one `error:` line naming the file or option, the
documented exit code, no traceback, and nothing from a checkpoint reaching the terminal unescaped.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from corrupt import SHARD3, rewrite_header
from helpers import run_cli, error_line, without_hint
from trellis_cli import synth
from trellis_cli.cli import output
from trellis_cli.id_ranges import expand_ranges

# A lone surrogate is refused by the header parser itself (test_robust_sources.py), so it is not in here.
EVIL = "x\n\x1b[2K\rPASS: everything is fine\n:x: [bold]b[/bold]\u202e"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.setattr(output.state, "debug", False)  # --debug in one test must not leak into the next


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("robust") / "src", synth.preset("tiny"))


@pytest.fixture
def evil(tmp_path, source) -> Path:
    """The tiny checkpoint with one tensor renamed to EVIL (the header keeps its length)."""
    root = tmp_path / "evil"
    subprocess.run(["cp", "-r", str(source), str(root)], check=True)

    def rename(header: dict) -> None:
        name = next(k for k in header if k != "__metadata__")
        header[EVIL] = header.pop(name)
        header.pop("__metadata__", None)  # room for the escapes json.dumps writes

    rewrite_header(root / SHARD3, rename)
    return root


def assert_inert(text: str) -> None:
    """Nothing a terminal would act on, and no forged verdict line."""
    assert "\x1b" not in text and "\r" not in text and "\u202e" not in text
    assert not any(line.startswith("PASS: everything") for line in text.splitlines())
    assert "\u274c" not in text  # rich's emoji for :x:


# ---- names from the checkpoint -----------------------------------------------------------------------

def test_evil_tensor_name_is_escaped_in_validate_findings(capsys, evil):
    code, out, err = run_cli(capsys, "validate", str(evil))
    assert code == 1
    assert_inert(out + err)
    line = next(line for line in out.splitlines() if "index.unindexed" in line)
    # Shown, escaped, on the finding's own line; markup and emoji codes stay literal text.
    assert "x\\x0a\\x1b[2K\\x0dPASS: everything is fine\\x0a:x: [bold]b[/bold]\\u202e" in line
    assert "FAIL: " in out and "FAIL" not in err  # the verdict is said once, on stdout


def test_evil_tensor_name_round_trips_in_json(capsys, evil):
    code, out, _ = run_cli(capsys, "validate", str(evil), "--json")
    assert code == 1
    names = [f["location"].get("tensor") for f in json.loads(out)["findings"]]
    assert EVIL in names


def test_inspect_of_the_evil_checkpoint_is_inert(capsys, evil):
    code, out, err = run_cli(capsys, "inspect", str(evil))
    assert code == 0 and "layer 3" in out
    assert_inert(out + err)


def test_error_messages_escape_what_they_quote(capsys, tmp_path):
    code, out, err = run_cli(capsys, "validate", str(tmp_path / "a\n\x1b[2KPASS: everything is fine"))
    assert code == 3 and out == ""
    assert len(without_hint(err).splitlines()) == 1 and err.startswith("error: ") and "\\x0a\\x1b[2KPASS" in err
    assert_inert(err)


def test_piped_tables_keep_their_numbers(capsys, monkeypatch):
    """Without a terminal rich would fit a table into 80 columns and cut "184.3" to "18…"."""
    from rich.table import Table

    monkeypatch.delenv("COLUMNS", raising=False)
    console = output._console(sys.stdout)  # as the module builds its own when stdout is not a terminal

    columns = ("M", "fused med µs", "min", "max", "two-pass µs", "fused/2p", "experts", "MB", "GB/s", "% copy",
               "TFLOP/s", "Gw/ms")
    table = Table()
    for column in columns:
        table.add_column(column)
    table.add_row("8", "184.3", "183.1", "185.0", "207.9", "0.89", "57", "225.4", "1223", "28.6", "6.6", "2.92")
    console.print(table)
    out = capsys.readouterr().out
    assert "…" not in out and "184.3" in out and "fused med µs" in out


def test_printable_escapes_controls_and_keeps_text():
    assert output.printable("a\x00\t\x1b\x7f\x85\ud800\u2028\u202e é→[b]") == \
        "a\\x00\\x09\\x1b\\x7f\\x85\\ud800\\u2028\\u202e é→[b]"


# ---- system errors and internal errors ---------------------------------------------------------------

def test_os_error_is_one_line_naming_the_file(capsys, source, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for extra in ([], ["--json"]):
        code, out, err = run_cli(capsys, "repack", str(source), str(blocker / "out"), *extra)
        assert code == 1 and out == ""
        assert error_line(err) == f"error: {blocker / 'out.partial.lock'}: Not a directory"
        assert err.count("error:") == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_permission_denied_is_one_line(capsys, source, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, out, err = run_cli(capsys, "repack", str(source), str(locked / "out"))
    finally:
        locked.chmod(0o755)
    assert code == 1 and out == ""
    last = error_line(err)
    assert last.startswith("error: ") and "Permission denied" in last and err.count("error:") == 1


@pytest.mark.slow
def test_full_disk_keeps_the_stage_and_a_rerun_resumes(source, tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "trellis_cli", "repack", str(source), str(out), "--jobs", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def small_files() -> None:  # as `ulimit -f 100`: writes past 100 KiB fail with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (100 << 10, 100 << 10))

    failed = subprocess.run(argv + ["--json"], capture_output=True, text=True, env=env, preexec_fn=small_files)
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.count("error:") == 1 and "Traceback" not in failed.stderr
    # The write that failed names its file, inside the kept stage, on the last line (after "opening ...").
    last = error_line(failed.stderr)
    assert last.startswith(f"error: {out}.partial/") and ".safetensors: File too large" in last
    assert f"the partial output {out}.partial is kept" in last and "rerun" in last
    assert (tmp_path / "out.partial").is_dir() and not out.exists()

    rerun = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming {out}.partial: " in rerun.stderr and out.is_dir()  # where the stage is, and how much


def test_unexpected_exception_is_an_internal_error(capsys, monkeypatch):
    from trellis_cli import inspect_report

    def broken(*_args, **_kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(inspect_report, "build_inspect", broken)
    code, out, err = run_cli(capsys, "inspect", "--json")
    assert code == 1 and out == ""
    assert error_line(err) == ("error: internal error: RuntimeError: boom\\x0asecond line "
                                    "(run with --debug for the traceback)")
    assert "Traceback" not in err

    code, out, err = run_cli(capsys, "--debug", "inspect")
    assert code == 1 and out == "" and "Traceback" in err and "RuntimeError" in err


# ---- ranges ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", [["validate"], ["inspect"], ["repack", "OUT"], ["synth"]])
@pytest.mark.parametrize("text, message", [
    ("²", "'²' is not an id or a range"),
    ("0-99999999999", "99999999999 is out of range"),
    ("", "--layers is empty"),
    ("3-5-7", "not an id or a range"),
])
def test_bad_layers_are_usage_errors(capsys, source, tmp_path, command, text, message):
    if command[0] == "synth":
        argv = ["synth", str(tmp_path / "s")]
    else:
        argv = [command[0], str(source)] + [str(tmp_path / "o")] * (len(command) - 1)
    code, out, err = run_cli(capsys, *argv, "--layers", text)
    assert code == 2 and out == ""
    assert err.startswith("error: --layers") and message in err and len(without_hint(err).splitlines()) == 1
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()


@pytest.mark.parametrize("text", ["", "0-99999999999", "x"])
def test_bad_repack_ranks_are_usage_errors(capsys, source, tmp_path, text):
    code, _, err = run_cli(capsys, "repack", str(source), str(tmp_path / "o"), "--ranks", text)
    assert code == 2 and err.startswith("error: --ranks") and len(without_hint(err).splitlines()) == 1


def test_layers_still_select(capsys, source):
    code, out, _ = run_cli(capsys, "inspect", str(source), "--layers", " 4 ", "--json")
    assert code == 0 and [row["layer"] for row in json.loads(out)["layers"]] == [4]


def test_expand_ranges_is_bounded():
    assert expand_ranges("0-2,5") == [0, 1, 2, 5]
    assert len(expand_ranges("0-1048575")) == 1 << 20
    with pytest.raises(ValueError, match="more than 1048576 ids"):
        expand_ranges("0-99999999999")
    with pytest.raises(ValueError, match="more than 8 ids"):
        expand_ranges("0-3,4-8", limit=8)
    for bad in ("²", "5-3", "+3", "1_0"):
        with pytest.raises(ValueError):
            expand_ranges(bad)
