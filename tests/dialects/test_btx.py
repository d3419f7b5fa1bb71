"""BTX (`btx-atoms-v1`), b12x 1.3.0's name for exl3-v1: detected, validated under b12x 1.3.0's rules, and
converted to and from exl3-v1 by renaming only, with b12x's own readers as the oracle.

b12x 1.3.0 runs in a subprocess from its own directory (`.b12x-1.3.0/` in the clone, or $TRELLIS_B12X_130:
`pip install --no-deps --target .b12x-1.3.0 b12x==1.3.0`; .ci/run does it); the installed b12x (1.5.1) reads
the exl3-v1 side. Tests that need a release skip when it is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli
from trellis_cli.synth import SynthSpec

REPO = Path(__file__).resolve().parents[2]
ORACLE = Path(__file__).with_name("b12x_oracle.py")
B12X_130 = Path(os.environ.get("TRELLIS_B12X_130", REPO / ".b12x-1.3.0"))
needs_130 = pytest.mark.skipif(not (B12X_130 / "b12x" / "moe" / "_shared" / "btx_schema.py").is_file(),
                               reason="b12x 1.3.0 is not installed (pip install --no-deps --target .b12x-1.3.0 "
                                      "b12x==1.3.0)")


def _has_151() -> bool:
    try:
        import b12x.moe.checkpoints.exl3  # noqa: F401
    except ImportError:
        return False
    return True


needs_151 = pytest.mark.skipif(not _has_151(), reason="b12x 1.5.x is not installed")


def oracle(release: str, *args: str):
    """b12x_oracle.py under b12x `release` ("1.3.0": its own directory; "1.5.1": the installed one)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if release == "1.3.0":
        env["PYTHONPATH"] = str(B12X_130)
    done = subprocess.run([sys.executable, str(ORACLE), *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def validate(capsys, root: Path, *args: str) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, "validate", str(root), "--json", *args)
    return code, json.loads(out)


def verdict(doc: dict, engine: str) -> dict:
    return next(v for v in doc["engines"] if v["name"] == engine)


def repack(capsys, src: Path, out: Path, to: str) -> Path:
    code, text, err = run_cli(capsys, "repack", str(src), str(out), "--to", to)
    assert code == 0, text + err
    return out


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


CONFIGS = {
    "uniform-mcg": {"codebook": "mcg", "num_experts": 4, "hidden_size": 256, "intermediate_size": 512,
                    "moe_layer_indices": [3, 5], "bits": 3},
    "pair-mcg": {"codebook": "mcg", "num_experts": 4, "hidden_size": 256, "intermediate_size": 512,
                 "moe_layer_indices": [3], "extent_alignment_slots": 8, "per_expert_input_rotations": True,
                 "rate_tables": {"3": [[[0x33, 0x44, 0x33, 0x33], [0x33, 0x44, 0x24, 0x33]]] * 2}},
    "hadamard-e4m3": {"codebook": "sqg_e4m3", "num_experts": 4, "hidden_size": 512, "intermediate_size": 1024,
                      "moe_layer_indices": [3], "bits": 2, "intermediate_hadamard": True, "pre_block": 512,
                      "post_block": 128, "extent_barriers": [16]},
}


@needs_130
@needs_151
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_btx_from_b12x_130_converts_losslessly(capsys, tmp_path, name):
    """b12x 1.3.0 writes BTX; trellis validates it under 1.3.0's rules, renames it to exl3-v1 (b12x 1.5.1 reads
    every extent with the same bytes 1.3.0 read) and back (every file identical to 1.3.0's own)."""
    src = tmp_path / "btx"
    assert oracle("1.3.0", "write", str(src), json.dumps(CONFIGS[name]))["container"] == "btx"
    code, doc = validate(capsys, src, "--deep")
    assert code == 0, doc["findings"]
    assert doc["context"]["dialect"] == "btx-atoms-v1" and doc["context"]["engine"] == "b12x-1.3.0"
    assert verdict(doc, "b12x-1.3.0")["loads"]
    refused = verdict(doc, "b12x-exl3-v1")
    assert not refused["loads"] and "b12x 1.3.0" in refused["reasons"][0]["message"]

    exl3 = repack(capsys, src, tmp_path / "exl3", "exl3-v1")
    code, doc = validate(capsys, exl3, "--deep")
    assert code == 0 and doc["context"]["dialect"] == "exl3-v1"
    seen_130, seen_151 = oracle("1.3.0", "read", str(src)), oracle("1.5.1", "read", str(exl3))
    assert seen_130["container"] == "btx" and seen_151["container"] == "exl3-v1"
    assert seen_130["extents"] == seen_151["extents"]
    assert seen_151["codebook"] == seen_130["codebook"].replace("sqg_", "lut_")

    back = repack(capsys, exl3, tmp_path / "back", "btx")
    same_files(src, back)


@needs_130
@needs_151
@pytest.mark.slow
def test_exl3v1_from_b12x_151_converts_to_btx(capsys, tmp_path):
    """b12x 1.5.1 writes exl3-v1 (pair rates, per-expert hidden tables); --to btx is read by b12x 1.3.0 with the
    same bytes, and --to exl3-v1 gives back b12x 1.5.1's files byte for byte."""
    src = tmp_path / "exl3"
    assert oracle("1.5.1", "write", str(src), json.dumps(CONFIGS["pair-mcg"]))["container"] == "exl3-v1"
    btx = repack(capsys, src, tmp_path / "btx", "btx")
    assert sorted(p.name for p in btx.iterdir()) == ["btx-layer-00003.safetensors", "btx-manifest.json"]
    assert oracle("1.5.1", "read", str(src))["extents"] == oracle("1.3.0", "read", str(btx))["extents"]
    same_files(src, repack(capsys, btx, tmp_path / "back", "exl3-v1"))


@pytest.fixture
def btx_dir(capsys, tmp_path) -> Path:
    """A BTX checkpoint made by trellis alone: its own exl3-v1 synth, renamed."""
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    spec = SynthSpec(hidden=256, intermediate=512, experts=4, tp=1, layers=(3,), uniform_k=3, top_k=2)
    exl3 = write_exl3v1_checkpoint(tmp_path / "exl3", spec)
    return repack(capsys, exl3, tmp_path / "btx", "btx")


def _edit_manifest(root: Path, edit) -> Path:
    path = root / "btx-manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    return root


def _rename_key(section: str, old: str, new: str):
    def edit(doc):
        doc[section][new] = doc[section].pop(old)
    return edit


def _set(key: str, value):
    def edit(doc):
        doc[key] = value
    return edit


# (manifest edit, the finding code, the field it names): each an exl3-v1 spelling in a BTX manifest.
REFUSALS = {
    "slot_channels": (_rename_key("geometry", "atom_channels", "slot_channels"), "btx.key-unknown",
                      "geometry.slot_channels"),
    "num_slots": (_rename_key("geometry", "atom_slots", "num_slots"), "btx.key-unknown", "geometry.num_slots"),
    "intermediate_hadamard": (_rename_key("hadamard", "coupled", "intermediate_hadamard"), "btx.key-unknown",
                              "hadamard.intermediate_hadamard"),
    "row_alignment": (_rename_key("layout", "atom_row_alignment", "row_alignment"), "btx.key-unknown",
                      "layout.row_alignment"),
    "lut_codebook": (lambda doc: (doc.update(codebook="lut_e4m3"), doc.pop("codebook_seed")), "btx.codebook",
                     "codebook"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_exl3v1_names_in_a_btx_manifest_are_refused_by_name(capsys, btx_dir, case):
    edit, code_, field = REFUSALS[case]
    _edit_manifest(btx_dir, edit)
    code, doc = validate(capsys, btx_dir)
    assert code == 1 and doc["context"]["dialect"] == "btx-atoms-v1"
    hit = [f for f in doc["findings"] if f["code"] == code_ and f["location"].get("tensor") == field]
    assert hit, doc["findings"]
    assert "b12x 1.3.0" in hit[0]["message"]
    assert not verdict(doc, "b12x-1.3.0")["loads"]


@needs_130
def test_b12x_130_refuses_what_trellis_refuses(capsys, btx_dir, tmp_path):
    """The same edits through b12x 1.3.0's own manifest parser: it refuses each one; the unedited one parses."""
    roots = []
    for case, (edit, _, _) in REFUSALS.items():
        roots.append(_edit_manifest(Path(shutil.copytree(btx_dir, tmp_path / case)), edit))
    seen = oracle("1.3.0", "manifest", str(btx_dir), *map(str, roots))
    assert seen[0] == {"ok": True}
    assert all("error" in s for s in seen[1:]), seen


def test_exl3v1_tensor_names_in_a_btx_layer_are_refused(capsys, btx_dir):
    """`codes` in a BTX layer file: the tensor set b12x 1.3.0's reader requires names `atoms`."""
    from trellis_cli.dialects.btx.write import write_renamed_layer

    layer = btx_dir / "btx-layer-00003.safetensors"
    renamed = write_renamed_layer(layer, btx_dir / "x.safetensors", to_btx=False, on_bytes=lambda _n: None)
    assert renamed
    os.replace(btx_dir / "x.safetensors", layer)
    code, doc = validate(capsys, btx_dir)
    assert code == 1
    found = {(f["code"], f["location"].get("tensor")) for f in doc["findings"]}
    assert ("btx.tensor-set", "codes") in found and ("btx.tensor-set", "atoms") in found
    assert ("btx.metadata", "__metadata__.schema") in found


def test_btx_claim_that_cannot_be_read_is_named(capsys, btx_dir):
    _edit_manifest(btx_dir, _set("schema", "exl3-v1"))
    code, doc = validate(capsys, btx_dir)
    assert code == 1 and doc["findings"][0]["code"] == "dialect.unknown"
    assert "btx-atoms-v1" in doc["findings"][0]["message"]


def test_inspect_and_diff_read_btx_as_exl3v1(capsys, btx_dir):
    exl3 = btx_dir.parent / "exl3"
    code, out, _ = run_cli(capsys, "inspect", str(btx_dir), "--json")
    assert code == 0 and json.loads(out)["dialect"] == "btx-atoms-v1"
    code, out, _ = run_cli(capsys, "diff", str(btx_dir), str(exl3))
    assert code == 0, out
    code, out, _ = run_cli(capsys, "inspect", str(btx_dir), "--tensors", "--json")
    doc = json.loads(out)
    assert code == 0 and "atoms" in {row["name"] for row in doc["tensors"]}  # listed as stored
    assert [t["code_bits_per_weight"] for t in doc["layers"]] == [3.0]  # and read as the codes table it is


def test_btx_converts_only_to_and_from_exl3v1(capsys, btx_dir, tmp_path):
    code, out, err = run_cli(capsys, "repack", str(btx_dir), str(tmp_path / "rp"), "--to", "route-pack")
    assert code == 2 and "--to exl3-v1" in err
    code, out, err = run_cli(capsys, "repack", str(btx_dir), str(tmp_path / "x"), "--to", "exl3-v1", "--tp", "2")
    assert code == 2 and "no rank axis" in err
