"""A layer `file` in the exl3-v1 manifest is read as b12x 1.5.1 reads it (issue 42, class 12): b12x joins it onto
the directory with pathlib, so `./x`, `x/` and `a//x` name file x; trellis normalises the same way, and stays
strict where b12x is not (an absolute path, `..`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import exl3v1_specs, run_cli_merged
from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

LAYER = "exl3-layer-00003.safetensors"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_exl3v1_checkpoint(tmp_path_factory.mktemp("exl3") / "exl3", exl3v1_specs()["uniform-shared"])


def with_layer_file(pristine: Path, target: Path, written: str) -> Path:
    shutil.copytree(pristine, target)
    manifest = json.loads((target / "exl3-manifest.json").read_text())
    manifest["layers"]["3"]["file"] = written
    (target / "exl3-manifest.json").write_text(json.dumps(manifest))
    return target


@pytest.mark.parametrize("written", [f"./{LAYER}", f"{LAYER}/", f".//{LAYER}", f"././{LAYER}/"])
def test_a_layer_file_b12x_normalises_is_accepted(capsys, pristine, tmp_path, written):
    root = with_layer_file(pristine, tmp_path / "exl3", written)
    b12x = pytest.importorskip("b12x.moe.checkpoints.exl3")
    manifest = b12x.read_exl3_manifest(root)
    b12x.read_exl3_layer(root, manifest, 3, first_slot=0, slot_count=manifest.geometry.num_slots, verify_sha=True)
    code, text = run_cli_merged(capsys, "validate", str(root), "--checksums")
    assert code == 0, text
    code, text = run_cli_merged(capsys, "repack", str(root), str(tmp_path / "tr3"), "--to", "tr3")
    assert code == 0, text


@pytest.mark.parametrize("written", [f"/{LAYER}", f"../exl3/{LAYER}", f"sub/../{LAYER}", ".", "./", ""])
def test_absolute_dotdot_and_directory_layer_files_stay_refused(capsys, pristine, tmp_path, written):
    root = with_layer_file(pristine, tmp_path / "exl3", written)
    (root / "sub").mkdir()
    code, text = run_cli_merged(capsys, "validate", str(root))
    assert code == 1 and "exl3v1.file-path" in text, text
