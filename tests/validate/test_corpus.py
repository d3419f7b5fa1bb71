"""The robustness corpus at the CLI boundary: each malformed checkpoint gives its named finding and exit 1,
never a traceback, in text and in --json mode."""

from __future__ import annotations

import json
import shutil

import pytest

from corrupt import CORPUS
from helpers import run_cli
from trellis_cli.synth import preset, write_checkpoint


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("corpus") / "tiny", preset("tiny"))


def test_pristine_checkpoint_passes(pristine, capsys):
    code, out, err = run_cli(capsys, "validate", str(pristine), "--deep")
    assert code == 0, out
    verdict, engines = out.strip().splitlines()[-2:]
    assert verdict.startswith("PASS") and engines.startswith("loads on: vllm-exl3 (shared-H rules) ✓")


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_corrupt_checkpoint_gives_named_finding_and_exit_1(case, pristine, tmp_path, capsys):
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    corrupt, deep = CORPUS[case]
    expected_code = corrupt(root)
    argv = ["validate", str(root), "--json"] + (["--deep"] if deep else [])
    code, out, err = run_cli(capsys, *argv)
    assert code == 1, err
    assert "Traceback" not in out + err
    document = json.loads(out)
    codes = {f["code"] for f in document["findings"] if f["severity"] == "error"}
    assert expected_code in codes, (expected_code, codes)
    assert document["ok"] is False and document["summary"].startswith("FAIL")
    # The same case in text mode: the finding line and the verdict, said once (on stdout, not again on stderr).
    code, out, err = run_cli(capsys, *["validate", str(root)] + (["--deep"] if deep else []))
    assert code == 1
    assert f"[{expected_code}]" in out
    verdict, engines = out.strip().splitlines()[-2:]
    assert verdict.startswith("FAIL") and engines.startswith("loads on: vllm-exl3 (shared-H rules) ✗")
    assert "FAIL" not in err and "error:" not in err and "Traceback" not in err
