"""Every dialect through one registry: a verdict per engine profile for each, the shared rules for each, the
library and the CLI agreeing, and no dialect name compared outside trellis_cli/dialects/."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from helpers import run_cli, tiny_checkpoint, to_plain_exl3, to_r7
from trellis_cli.header import read_local_header
from trellis_cli.sample import sample_path
from trellis_cli.validate.engines import BY_NAME

PACKAGE = Path(__file__).resolve().parents[2] / "trellis_cli"
EXL3V1_MANIFEST = "exl3-manifest.json"
LAYER3 = "exl3-layer-00003.safetensors"


@pytest.fixture(scope="module")
def exl3v1(tmp_path_factory) -> Path:
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
    from trellis_cli.synth import SynthSpec

    spec = SynthSpec(hidden=256, intermediate=512, experts=4, tp=1, layers=(3,), partition=(3, 1), top_k=2)
    return write_exl3v1_checkpoint(tmp_path_factory.mktemp("exl3v1") / "v1", spec)


@pytest.fixture(scope="module")
def route_pack(tmp_path_factory) -> Path:
    from trellis_cli import run_repack

    return Path(run_repack(sample_path("tr3"), tmp_path_factory.mktemp("pack") / "pack").out)


def _copy(src: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, tmp_path / src.name))


def _json(capsys, *args: str) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, "validate", *args, "--json")
    return code, json.loads(out)


@pytest.mark.parametrize("which", ["sample", "exl3v1", "route_pack"])
def test_every_dialect_ends_with_a_verdict_per_engine(capsys, request, which):
    args = [] if which == "sample" else [str(request.getfixturevalue(which))]
    code, out, _ = run_cli(capsys, "validate", *args)
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("loads on")
    assert "engine rules enforced:" in out
    code, doc = _json(capsys, *args)
    # A profile read for one layout only (`Engine.scope`: PR #766, the GLM-5.3 stream) is listed for it alone.
    assert code == 0 and sorted(v["name"] for v in doc["engines"]) == sorted(
        name for name, engine in BY_NAME.items() if engine.scope is None)


@pytest.mark.parametrize("engine", ["vllm-exl3-190", "vllm-exl3-shared-h", "exllamav3"])
def test_loaders_that_cannot_read_exl3v1_refuse_it_by_name(capsys, exl3v1, engine):
    code, out, _ = run_cli(capsys, "validate", str(exl3v1), "--engine", engine)
    assert code == 1 and "[engine.container]" in out and "exl3-v1" in out
    code, doc = _json(capsys, str(exl3v1), "--engine", engine)
    enforced = [v for v in doc["engines"] if v["enforced"]]
    assert code == 1 and [v["name"] for v in enforced] == [engine] and not enforced[0]["loads"]
    assert doc["context"]["engine"] == engine


def test_b12x_refuses_tr3_and_loads_exl3v1(capsys, exl3v1):
    code, out, _ = run_cli(capsys, "validate", "--engine", "b12x-exl3-v1")
    assert code == 1 and "[engine.container]" in out
    code, doc = _json(capsys, str(exl3v1))
    verdicts = {v["name"]: v["loads"] for v in doc["engines"]}
    assert code == 0 and doc["context"]["engine"] == "b12x-exl3-v1" and verdicts == {
        "b12x-exl3-v1": True, "vllm-exl3-shared-h": False, "vllm-exl3-190": False, "exllamav3": False,
        "vllm-exl3-r7": False, "vllm-exl3-manifest": False,  # the manifest loader: no config.json (no stamp)
        "b12x-1.3.0": False}  # b12x 1.3.0 reads BTX, the same container under its earlier names


def _zero_rows(root: Path, expert: int) -> None:
    """Zero one expert's row of every hidden-side table of layer 3 and record the file's new sha256."""
    import hashlib

    header = read_local_header(root / LAYER3, LAYER3)
    with open(root / LAYER3, "r+b") as f:
        for table in ("gate_suh", "up_suh", "down_svh"):
            entry = header.tensors[table]
            row = (entry.end - entry.begin) // entry.shape[0]
            f.seek(header.data_start + entry.begin + expert * row)
            f.write(bytes(row))
    manifest = json.loads((root / EXL3V1_MANIFEST).read_text())
    manifest["layers"]["3"]["sha256"] = hashlib.sha256((root / LAYER3).read_bytes()).hexdigest()
    (root / EXL3V1_MANIFEST).write_text(json.dumps(manifest))


def test_exl3v1_zero_vectors_are_the_shared_data_finding(capsys, exl3v1, tmp_path):
    root = _copy(exl3v1, tmp_path)
    _zero_rows(root, expert=0)
    code, out, _ = run_cli(capsys, "validate", str(root))
    assert code == 0 and "tensor data not checked" in out  # headers only: says what it did not read
    code, doc = _json(capsys, str(root), "--deep")
    zero = [f for f in doc["findings"] if f["code"] == "data.zero-vector"]
    assert code == 1 and len(zero) == 3 and {f["location"]["expert"] for f in zero} == {0}
    assert {f["location"]["tensor"] for f in zero} == {"gate_suh[0]", "up_suh[0]", "down_svh[0]"}


def test_exl3v1_stale_layer_hash_is_a_finding_by_default(capsys, exl3v1, tmp_path):
    root = _copy(exl3v1, tmp_path)
    manifest = json.loads((root / EXL3V1_MANIFEST).read_text())
    manifest["layers"]["3"]["sha256"] = "ab" * 32
    (root / EXL3V1_MANIFEST).write_text(json.dumps(manifest))
    code, out, _ = run_cli(capsys, "validate", str(root))
    assert code == 1 and "[exl3v1.sha256-mismatch]" in out


def _unknown(tmp_path: Path) -> Path:
    root = tmp_path / "unknown"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    return root


def _k345(tmp_path: Path) -> Path:
    """Three bitrates in one layer: the format allows it, the default (rank-sliced vLLM) profile refuses it."""
    from trellis_cli.synth import preset, write_checkpoint
    from dataclasses import replace

    spec = replace(preset("tiny"), partition=None, uniform_k=None,
                   bitmap={3: (3, 3, 4, 4, 5, 5, 3, 4), 4: (3,) * 4 + (4,) * 4})
    return write_checkpoint(tmp_path / "k345", spec)


@pytest.mark.parametrize("which", ["tr3", "shared_h", "plain_exl3", "r7", "k345", "exl3v1", "route_pack",
                                   "glm53", "unknown", "unreadable"])
def test_the_library_and_the_cli_give_the_same_report(capsys, request, tmp_path, which):
    from trellis_cli import open_source, validate_source, ValidateRequest

    root = {"tr3": lambda: sample_path("tr3"), "shared_h": lambda: sample_path("tr3-shared-h"),
            "plain_exl3": lambda: to_plain_exl3(tiny_checkpoint(tmp_path, tp=1)),
            "r7": lambda: to_r7(tiny_checkpoint(tmp_path)), "k345": lambda: _k345(tmp_path),
            "exl3v1": lambda: request.getfixturevalue("exl3v1"),
            "route_pack": lambda: request.getfixturevalue("route_pack"), "unknown": lambda: _unknown(tmp_path),
            "glm53": lambda: _glm53(tmp_path),
            "unreadable": lambda: _unreadable(tmp_path)}[which]()
    report = validate_source(open_source(str(root)), ValidateRequest())
    code, doc = _json(capsys, str(root))
    assert report.ok == (code == 0)
    assert [(f.code, f.severity.value) for f in report.findings] == [(f["code"], f["severity"])
                                                                     for f in doc["findings"]]
    assert [(v["name"], v["loads"], v["enforced"]) for v in report.engines] == [
        (v["name"], v["loads"], v["enforced"]) for v in doc["engines"]]
    assert report.context.get("engine") == doc["context"].get("engine")
    if which == "k345":  # the case: the library enforces the default engine as the CLI does
        from trellis_cli import open_checkpoint, run_validation

        assert not report.ok and report.context["engine"] == "vllm-exl3-shared-h"
        assert not run_validation(open_checkpoint(open_source(str(root)))).ok
    if which in ("unknown", "unreadable"):
        assert report.findings[0].code == {"unknown": "dialect.unknown", "unreadable": "checkpoint.unreadable"}[which]


def _glm53(tmp_path: Path) -> Path:
    from trellis_cli.dialects.glm53.synth import preset, write_stream_checkpoint

    return write_stream_checkpoint(tmp_path / "glm53", preset("glm53-tiny"))


def _unreadable(tmp_path: Path) -> Path:
    root = tmp_path / "unreadable"
    root.mkdir()
    (root / "config.json").write_text("[1, 2]")  # JSON, but not an object: nothing can be trusted
    return root


# ---- no dialect name compared outside trellis_cli/dialects/ ---------------------------------------------

# The Checkpoint.dialect values that name only a dialect ("exl3" and "r7" are also quant_method and option
# words, so a bare string of those is not taken for one).
DIALECT_STRINGS = {"tr3/per_expert_v1", "tr3/shared_h_v1", "trellis-route-pack", "exl3-v1"}
DEFINED_IN = PACKAGE / "checkpoint" / "model.py"  # where the DIALECT_* constants are defined


def _dialect_comparisons(path: Path) -> list[str]:
    wrong = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Name) and node.id.startswith("DIALECT_"):
            wrong.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.alias) and node.name.startswith("DIALECT_"):
            wrong.append(f"imports {node.name}")
        elif isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                for sub in ast.walk(side):
                    if isinstance(sub, ast.Attribute) and sub.attr == "dialect":
                        wrong.append(f"{node.lineno}: compares .dialect")
                    elif (isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant)
                          and sub.slice.value == "dialect"):
                        wrong.append(f"{node.lineno}: compares ['dialect']")
                    elif isinstance(sub, ast.Constant) and sub.value in DIALECT_STRINGS:
                        wrong.append(f"{node.lineno}: compares {sub.value!r}")
    return wrong


def test_no_dialect_name_is_compared_outside_the_dialects_package():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "dialects") in path.parents or path == DEFINED_IN:
            continue
        wrong += [f"{path.relative_to(PACKAGE.parent)}:{w}" for w in _dialect_comparisons(path)]
    assert not wrong, "\n".join(wrong)


def test_the_name_check_sees_each_form(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('from m import DIALECT_R7\nif ck.dialect == "x": pass\nif doc["dialect"] == y: pass\n'
                      'if kind in ("exl3-v1", "tr3"): pass\n')
    assert len(_dialect_comparisons(sample)) == 4


def test_every_conversion_names_its_targets_writer_in_the_targets_package():
    """The (from, to) table: each row's writer is a module of the target dialect's own package."""
    import importlib

    from trellis_cli.dialects import registry

    rows = registry.conversions()
    assert {row.target for row in rows} == set(registry.targets())
    for row in rows:
        target = next(d for d in registry.DIALECTS if d.target == row.target)
        package = type(target).__module__
        assert row.writer.startswith(package + "."), (row, package)
        importlib.import_module(row.writer)
        assert registry.conversion(row.source, row.target) == row.driver


@pytest.mark.parametrize("which", ["sample", "exl3v1", "route_pack"])
def test_a_file_linking_out_of_any_dialect_is_the_one_name_finding(capsys, request, tmp_path, which):
    """One name rule for every dialect: a listed file whose link leads outside the checkpoint is path.escape
    (never read), a dangling link path.dangling, the same words whichever dialect holds them."""
    source = sample_path("tr3") if which == "sample" else request.getfixturevalue(which)
    ckpt = _copy(source, tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the checkpoint\n", encoding="utf-8")
    (ckpt / "notes.txt").symlink_to(outside)
    (ckpt / "gone.txt").symlink_to("absent.txt")  # inside the directory, to nothing
    code, doc = _json(capsys, str(ckpt))
    found = {(f["code"], f["location"]["file"], f["message"]) for f in doc["findings"]
             if f["code"].startswith("path.")}
    assert code == 1
    assert found == {("path.escape", "notes.txt", "file resolves outside the checkpoint directory (symlink)"),
                     ("path.dangling", "gone.txt", "file is a dangling link (or a symlink loop)")}, found
