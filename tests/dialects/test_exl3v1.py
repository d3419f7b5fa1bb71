"""exl3-v1: detection by manifest content, inspect, synth, and every validate fault class with its finding."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest

from trellis_cli.dialects import open_checkpoint
from trellis_cli.header import read_local_header
from trellis_cli.synth import SynthSpec, preset
from helpers import run_cli as run_cli_split

MANIFEST = "exl3-manifest.json"
LAYER3 = "exl3-layer-00003.safetensors"


def run_cli(capsys, *args: str, stdout_only: bool = False) -> tuple[int, str]:
    code, out, err = run_cli_split(capsys, *args)
    return code, out if stdout_only else out + err


def synth_exl3v1(capsys, out: Path, *extra: str) -> Path:
    code, text = run_cli(capsys, "synth", str(out), "--format", "exl3-v1", *extra)
    assert code == 0, text
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Mixed K3/K4 (per_expert_pair), 5 + 1 experts so rows carry 3072 bytes of padding, per-expert H tables."""
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    spec = SynthSpec(hidden=256, intermediate=512, experts=6, tp=1, layers=(3, 4), partition=(5, 1), top_k=2)
    return write_exl3v1_checkpoint(tmp_path_factory.mktemp("exl3v1") / "mixed", spec)


def copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def edit_manifest(root: Path, change) -> None:
    doc = json.loads((root / MANIFEST).read_text())
    change(doc)
    (root / MANIFEST).write_text(json.dumps(doc))


def rehash(root: Path, layer: str = "3", name: str = LAYER3) -> None:
    digest = hashlib.sha256((root / name).read_bytes()).hexdigest()
    edit_manifest(root, lambda d: d["layers"][layer].update(sha256=digest))


def poke(root: Path, tensor: str, offset: int, data: bytes, name: str = LAYER3) -> None:
    """Overwrite bytes inside one tensor of a layer file (then fix the manifest digest)."""
    header = read_local_header(root / name, name)
    entry = header.tensors[tensor]
    with open(root / name, "r+b") as f:
        f.seek(header.data_start + entry.begin + offset)
        f.write(data)
    rehash(root)


def rewrite_layer(root: Path, change, metadata_change=None) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = root / LAYER3
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = dict(f.metadata())
    change(tensors)
    if metadata_change:
        metadata_change(metadata)
    save_file(tensors, str(path), metadata)
    rehash(root)


def validate(capsys, root: Path, *extra: str) -> tuple[int, str]:
    return run_cli(capsys, "validate", str(root), "--json", *extra, stdout_only=True)


def inspect_json(capsys, root: Path, *extra: str) -> dict:
    code, out = run_cli(capsys, "inspect", str(root), "--json", *extra, stdout_only=True)
    assert code == 0, out
    return json.loads(out)


def codes_of(capsys, root: Path, *extra: str) -> set[str]:
    code, text = validate(capsys, root, *extra)
    doc = json.loads(text)
    found = {f["code"] for f in doc["findings"] if f["severity"] == "error"}
    assert (code == 1) == bool(found), text
    return found


def test_synth_validates_and_inspects(capsys, mixed):
    ckpt = open_checkpoint(mixed)
    assert ckpt.dialect == "exl3-v1" and ckpt.hidden == 256 and ckpt.num_experts == 6
    assert codes_of(capsys, mixed, "--deep", "--checksums") == set()
    doc = inspect_json(capsys, mixed)
    row = doc["layers"][0]
    assert row["partition"] == "5/1" and row["k_values"] == [3, 4] and row["bpw"] == pytest.approx(19 / 6, 1e-3)
    assert row["row_stride"] == 61440 and row["row_payload"] == 5 * 9216 + 12288
    assert doc["exl3v1"]["tp_degrees"] == [1, 2] and doc["exl3v1"]["pair_kinds"] == ["P33", "P44"]
    assert row["rank_bytes"]["2"] < row["rank_bytes"]["1"]
    code, text = run_cli(capsys, "inspect", str(mixed))
    assert code == 0 and "TP degrees the slot layout allows: 1, 2" in text


def test_detected_by_content_not_name(capsys, mixed, tmp_path):
    root = copy(mixed, tmp_path)
    for name in (LAYER3, "exl3-layer-00004.safetensors"):
        (root / name).rename(root / name.replace("exl3-layer-", "weights-"))
    edit_manifest(root, lambda d: [d["layers"][k].update(file=d["layers"][k]["file"].replace("exl3-layer-", "weights-"))
                                   for k in d["layers"]])
    assert codes_of(capsys, root) == set()
    edit_manifest(root, lambda d: d.update(schema="exl3-v2"))
    code, text = validate(capsys, root)
    assert code == 1 and "exl3-v2" in text


@pytest.mark.parametrize("change,finding", [
    (lambda d: d["geometry"].update(num_experts=True), "exl3v1.type"),
    (lambda d: d["geometry"].update(hidden_size=256.0), "exl3v1.type"),
    (lambda d: d["layers"].update({"03": d["layers"].pop("3")}), "exl3v1.layer-key"),
    (lambda d: d["layers"]["3"].update(sha256="z" * 64), "exl3v1.sha256-format"),
    (lambda d: d["layers"]["3"].update(file="../escape.safetensors"), "exl3v1.file-path"),
    (lambda d: d["layout"].update(extent_alignment_slots=4), "exl3v1.pair-alignment"),
    (lambda d: d.update(codebook_seed=1), "exl3v1.codebook-seed"),
    (lambda d: d.update(extra=1), "exl3v1.key-unknown"),
    (lambda d: d["rates"].update(pair_kinds=["P33"]), "exl3v1.rate-undeclared"),
    (lambda d: d["geometry"].update(num_slots=8), "exl3v1.geometry"),
])
def test_manifest_faults(capsys, mixed, tmp_path, change, finding):
    root = copy(mixed, tmp_path)
    edit_manifest(root, change)
    assert finding in codes_of(capsys, root)


def test_layer_faults(capsys, mixed, tmp_path):
    import torch

    cases = [
        (lambda t: t.update(codes=t["codes"].view(torch.int8)), None, "exl3v1.dtype"),
        (lambda t: t.update(rotations=t["rotations"].to(torch.bfloat16)), None, "exl3v1.dtype"),
        (lambda t: t.update(rates_fc1=t["rates_fc1"].to(torch.int16)), None, "exl3v1.dtype"),
        (lambda t: t.update(extra=torch.zeros(1)), None, "exl3v1.tensor-set"),
        (lambda t: t.pop("rates_fc2"), None, "exl3v1.tensor-set"),
        (lambda t: t.update(codes=t["codes"][:, :57344].clone()), None, "exl3v1.row-short"),
        (lambda t: t.update(codes=t["codes"][:, :61000].clone()), None, "exl3v1.row-alignment"),
        (lambda t: None, lambda m: m.update(layer="4"), "exl3v1.metadata"),
        (lambda t: None, lambda m: m.pop("hidden_size"), "exl3v1.metadata"),
    ]
    for change, meta, finding in cases:
        root = copy(mixed, tmp_path)
        rewrite_layer(root, change, meta)
        assert finding in codes_of(capsys, root), finding
        shutil.rmtree(root)


def test_data_faults(capsys, mixed, tmp_path):
    root = copy(mixed, tmp_path)
    poke(root, "codes", 61440 * 2 + 58368 + 10, b"\x01")  # row 2, inside its 3072 padding bytes
    assert codes_of(capsys, root) == {"exl3v1.padding"}
    shutil.rmtree(root)
    root = copy(mixed, tmp_path)
    poke(root, "rates_fc2", 1, b"\x55")
    assert codes_of(capsys, root) == {"exl3v1.rate-code"}
    shutil.rmtree(root)
    root = copy(mixed, tmp_path)
    poke(root, "rates_fc1", 0, b"\x24")
    assert "exl3v1.rate-undeclared" in codes_of(capsys, root)
    shutil.rmtree(root)
    root = copy(mixed, tmp_path)
    poke(root, "rotations", 64, b"\x00\x7e")  # fp16 NaN
    assert codes_of(capsys, root) == set()  # headers and small tables only by default
    assert codes_of(capsys, root, "--deep") == {"exl3v1.nonfinite"}
    shutil.rmtree(root)
    root = copy(mixed, tmp_path)
    poke(root, "up_suh", 10, b"\x00\x7c")  # +Inf: a hidden-side vector, checked by the data rules of every dialect
    assert codes_of(capsys, root, "--deep") == {"data.nonfinite"}


def test_checksums_and_missing_file(capsys, mixed, tmp_path):
    root = copy(mixed, tmp_path)
    edit_manifest(root, lambda d: d["layers"]["3"].update(sha256="0" * 64))
    assert codes_of(capsys, root) == set()
    assert codes_of(capsys, root, "--checksums") == {"exl3v1.sha256-mismatch"}
    (root / LAYER3).unlink()
    assert "exl3v1.layer-file-missing" in codes_of(capsys, root)


def test_production_sparse_validates_fast(capsys, tmp_path):
    out = synth_exl3v1(capsys, tmp_path / "glm", "--preset", "glm52-tp4", "--sparse", "--non-expert", "bf16")
    start = time.perf_counter()
    code, text = validate(capsys, out)
    assert code == 0, text
    assert time.perf_counter() - start < 20
    doc = inspect_json(capsys, out, "--layers", "3")
    row = doc["layers"][0]
    assert row["partition"] == "192/64" and row["bpw"] == 3.25 and doc["exl3v1"]["num_slots"] == 64
    assert doc["exl3v1"]["tp_degrees"] == [1, 2, 4, 8]
    assert row["rank_bytes"]["4"] == 16 * 61_341_696 + 16 * 256 * 96 * 2 + 2 * 2 * 256 + 3 * 256 * 6144 * 2


def test_synth_refuses_what_exl3v1_cannot_hold(capsys, tmp_path):
    code, text = run_cli(capsys, "synth", str(tmp_path / "x"), "--format", "exl3-v1", "--codebook", "3inst")
    assert code == 2 and "mcg" in text
    spec = replace(preset("tiny"), partition=None, uniform_k=None, bitmap={3: (3,) * 7 + (5,), 4: (3,) * 8})
    from trellis_cli.errors import UsageError
    from trellis_cli.dialects.exl3v1.synth import manifest_for

    with pytest.raises(UsageError, match="pair kinds"):
        manifest_for(spec)
