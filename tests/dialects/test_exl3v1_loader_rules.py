"""exl3-v1 directories the loader refuses, with b12x 1.5.1's own reader and adapter as the oracle (issue 42,
classes 6 and 8): the manifest validated is the one b12x opens (`exl3-manifest.json`), never one config.json
names instead; mcg below K3 is refused as b12x's trellis adapter refuses it; a link leaving the directory is
`path.escape` wherever it is, as repack refuses it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers import run_cli

b12x_exl3 = pytest.importorskip("b12x.moe.checkpoints.exl3")

MANIFEST = "exl3-manifest.json"
LAYER3 = "exl3-layer-00003.safetensors"


@pytest.fixture(scope="module")
def uniform_k3(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("loader") / "k3"
    status, _, err = run_cli(None, "synth", str(root), "--format", "exl3-v1", "--uniform", "3")
    assert status == 0, err
    return root


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def with_config_manifest(root: Path, name: str) -> None:
    (root / "config.json").write_text(json.dumps({"quantization_config": {"exl3": {"manifest": name}}}))


def validate(capsys, root: Path, *options: str) -> tuple[int, list[dict]]:
    status, out, err = run_cli(capsys, "validate", str(root), "--json", *options)
    assert "internal error" not in err, err
    return status, json.loads(out)["findings"]


def b12x_loads(root: Path) -> bool:
    """b12x's reader (with sha256 verification) and its trellis adapter, every layer, one extent."""
    try:
        manifest = b12x_exl3.read_exl3_manifest(root)
        for layer in manifest.geometry.moe_layer_indices:
            read = b12x_exl3.read_exl3_layer(root, manifest, layer, first_slot=0,
                                             slot_count=manifest.geometry.num_slots, verify_sha=True)
            b12x_exl3.trellis_from_exl3(read)
    except (OSError, ValueError, TypeError, KeyError, NotImplementedError):
        return False
    return True


def test_the_oracle_and_trellis_agree_on_the_clean_directory(capsys, uniform_k3):
    assert b12x_loads(uniform_k3)
    assert validate(capsys, uniform_k3, "--checksums") == (0, [])


# ---- class 6: the manifest the loader reads -----------------------------------------------------------

def test_a_manifest_only_under_the_name_config_gives_is_refused(capsys, uniform_k3, tmp_path):
    root = copy(uniform_k3, tmp_path / "ck")
    (root / MANIFEST).rename(root / "other-manifest.json")
    with_config_manifest(root, "other-manifest.json")
    assert not b12x_loads(root)  # it opens exl3-manifest.json, whatever config.json says

    status, findings = validate(capsys, root)
    assert status == 1
    assert [(f["code"], f["severity"], f["expected"], f["found"]) for f in findings] == [
        ("exl3v1.manifest-name", "error", MANIFEST, "other-manifest.json")]
    assert findings[0]["location"] == {"file": "config.json", "tensor": "quantization_config.exl3.manifest"}


@pytest.mark.parametrize("damage", ["sha256", "nan"])
def test_the_manifest_the_loader_reads_is_validated_not_the_one_config_names(capsys, uniform_k3, tmp_path, damage):
    root = copy(uniform_k3, tmp_path / "ck")
    shutil.copy(root / MANIFEST, root / "good-manifest.json")
    with_config_manifest(root, "good-manifest.json")
    text = (root / MANIFEST).read_text()
    digest = hashlib.sha256((root / LAYER3).read_bytes()).hexdigest()
    if damage == "sha256":
        text = text.replace(digest, "0" * 64)
    else:  # json.loads takes NaN; the parser then refuses a non-integer size
        doc = json.loads(text)
        text = json.dumps(doc, indent=2).replace('"hidden_size": 256', '"hidden_size": NaN')
    assert text != (root / MANIFEST).read_text()
    (root / MANIFEST).write_text(text)
    assert not b12x_loads(root)

    status, findings = validate(capsys, root, "--checksums")
    assert status == 1
    refusal = ("exl3v1.sha256-mismatch", LAYER3) if damage == "sha256" else ("exl3v1.type", MANIFEST)
    assert sorted((f["code"], f["location"]["file"]) for f in findings) == sorted([
        refusal, ("exl3v1.manifest-name", "config.json")]), findings
    assert next(f for f in findings if f["code"] == "exl3v1.manifest-name")["severity"] == "warning"


def test_a_config_naming_the_loaders_own_manifest_changes_nothing(capsys, uniform_k3, tmp_path):
    root = copy(uniform_k3, tmp_path / "ck")
    with_config_manifest(root, MANIFEST)  # what the vLLM fork's exl3 config carries
    assert b12x_loads(root)
    assert validate(capsys, root) == (0, [])


@pytest.mark.parametrize("k", [2, 3])
def test_mcg_below_k3_is_refused_as_the_trellis_adapter_refuses_it(capsys, tmp_path, k):
    root = tmp_path / f"k{k}"
    status, _, err = run_cli(capsys, "synth", str(root), "--format", "exl3-v1", "--uniform", str(k))
    assert status == 0, err
    loads = b12x_loads(root)
    status, findings = validate(capsys, root)
    assert loads == (k >= 3) and (status == 0) == loads
    if not loads:
        assert [(f["code"], f["location"]["tensor"], f["found"]) for f in findings] == [
            ("exl3v1.mcg-k2", "rates.bits", 2)]


# ---- class 8: links leaving the directory -------------------------------------------------------------

@pytest.mark.parametrize("name", ["notes.json", "extra.safetensors", "sub/readme.md"])
def test_an_escaping_link_anywhere_in_the_directory_is_path_escape(capsys, uniform_k3, tmp_path, name):
    root = copy(uniform_k3, tmp_path / "ck")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not part of the checkpoint")
    (root / name).parent.mkdir(exist_ok=True)
    (root / name).symlink_to(outside)
    status, findings = validate(capsys, root)
    assert status == 1
    assert [(f["code"], f["location"]["file"]) for f in findings] == [("path.escape", name)]

    out = tmp_path / "out"
    status, _, err = run_cli(capsys, "repack", str(root), str(out))
    assert status != 0 and not out.exists(), err  # repack refuses the same directory
    assert outside.read_bytes() == b"not part of the checkpoint"


def test_an_escaping_layer_file_and_a_dangling_link_are_named(capsys, uniform_k3, tmp_path):
    root = copy(uniform_k3, tmp_path / "ck")
    moved = tmp_path / LAYER3
    (root / LAYER3).rename(moved)
    (root / LAYER3).symlink_to(moved)
    (root / "gone.json").symlink_to(root / "never-there")  # dangling, inside
    status, findings = validate(capsys, root)
    assert status == 1
    assert sorted((f["code"], f["location"]["file"]) for f in findings) == [
        ("path.dangling", "gone.json"), ("path.escape", LAYER3)]
