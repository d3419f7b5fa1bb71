"""The console entry ends the process itself once a command has answered (`cli.app._exit_now`): everything the
command wrote must still arrive whole, through a pipe and into a file alike, with the command's own exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trellis_cli import synth

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth.write_checkpoint(tmp_path_factory.mktemp("exit") / "src", synth.preset("tiny"))


def _trellis(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trellis_cli", *args], cwd=REPO, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120)


def test_a_document_written_to_a_file_arrives_whole(tmp_path, source):
    # A file is block-buffered: the last block is written only by the flush before the process ends.
    target = tmp_path / "inspect.json"
    with open(target, "w") as out:
        done = _trellis("inspect", str(source), "--tensors", "--json", stdout=out)
    assert done.returncode == 0, done.stderr
    document = json.loads(target.read_text())
    assert document["dialect"] and len(target.read_bytes()) > 8192


def test_findings_and_their_exit_code_survive_the_early_end(tmp_path):
    broken = synth.write_checkpoint(tmp_path / "broken", synth.preset("tiny"))
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: validate names it and exits 1
    done = _trellis("validate", str(broken), "--json")
    assert done.returncode == 1
    codes = {f["code"] for f in json.loads(done.stdout)["findings"]}
    assert any(code.startswith("file.") for code in codes), codes


def test_a_usage_error_keeps_its_code_and_line():
    done = _trellis("no-such-command")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "no-such-command" in done.stderr
