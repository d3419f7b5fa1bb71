"""What a route pack is for and which target each engine loads, said where a user meets it; a mistyped relative
path that is no Hub repo either is said to be neither."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from helpers import run_cli, tiny_checkpoint


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_repack_help_names_each_engines_target(capsys):
    code, out, _ = run_cli(capsys, "repack", "--help")
    text = _flat(out)
    assert code == 0 and "loads in no serving engine" in text
    assert "the vLLM fork loads --to tr3" in text and "b12x loads --to exl3-v1" in text


def test_a_route_packs_validate_and_inspect_say_what_it_is_for(capsys, tmp_path):
    src = tiny_checkpoint(tmp_path)
    pack = tmp_path / "pack"
    assert run_cli(capsys, "repack", str(src), str(pack))[0] == 0
    code, out, _ = run_cli(capsys, "validate", str(pack))
    assert code == 0 and "no serving engine loads it" in out and "--to tr3 --tp N` for the vLLM fork" in out
    code, out, _ = run_cli(capsys, "inspect", str(pack))
    assert code == 0 and "purpose: a route pack is the bundled fused kernel's own layout" in out
    code, out, _ = run_cli(capsys, "inspect", str(pack), "--json")
    assert "--to exl3-v1` for b12x" in json.loads(out)["purpose"]


def test_a_mistyped_relative_path_is_neither_a_directory_nor_a_reachable_repo(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    with socket.socket() as s:  # a port nothing listens on: the Hub is unreachable, at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = run_cli(capsys, "inspect", "work/glmm", "--endpoint", f"http://127.0.0.1:{port}",
                           "--cache-dir", str(tmp_path / "cache"))
    assert code == 3 and "work/glmm: neither a local directory" in err and "nor a reachable Hub repo" in err
    assert "./work/glmm" in err and "hf://work/glmm" in err and "Traceback" not in err
    assert not Path("work/glmm").exists()
