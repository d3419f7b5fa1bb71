"""`repack --dry-run` of a local TR3 plans from declarations, file sizes and the names in the raw headers:
the same plan as the full opening gives, without parsing a header, and the full opening where it cannot."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from corrupt import edit_json
from helpers import run_cli, tiny_checkpoint
from trellis_cli import header
from trellis_cli.dialects.open import open_checkpoint
from trellis_cli.repack.run import RepackOptions, run_repack
from trellis_cli.validate import run_validation

MIXED_SHARD = "model-layer-003.safetensors"


def with_mixed_shard(root: Path) -> Path:
    """Layer 3's shard also holds attention and norm tensors (as real shards do), and a dense shard is added."""
    gen = torch.Generator().manual_seed(44)
    tensors = load_file(str(root / MIXED_SHARD))
    others = {"model.layers.3.self_attn.o_proj.weight": torch.randn(64, 32, generator=gen).to(torch.bfloat16),
              "model.layers.3.input_layernorm.weight": torch.randn(256, generator=gen).to(torch.bfloat16)}
    save_file({**tensors, **others}, str(root / MIXED_SHARD), metadata={"format": "pt", "note": "mixed"})
    dense = {"model.embed_tokens.weight": torch.randn(512, 256, generator=gen).to(torch.bfloat16)}
    save_file(dense, str(root / "model-dense.safetensors"), metadata={"format": "pt"})

    def index(doc: dict) -> None:
        doc["weight_map"].update({name: MIXED_SHARD for name in others})
        doc["weight_map"].update({name: "model-dense.safetensors" for name in dense})
    edit_json(root / "model.safetensors.index.json", index)
    (root / "MANIFEST.sha256").unlink()
    return root


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("dry")
    plain = tiny_checkpoint(base, "plain")
    mixed = with_mixed_shard(tiny_checkpoint(base, "mixed", non_expert="none"))  # its own few non-expert tensors
    shared = tiny_checkpoint(base, "shared", rotation_layout="shared_h_v1")
    return {"plain": plain, "mixed": mixed, "shared": shared}


def full_plan(source: Path, out: Path, **options) -> dict:
    """The plan of the full opening (every header parsed into the checkpoint model)."""
    result = run_repack(open_checkpoint(source), out, RepackOptions(dry_run=True, **options),
                        validator=run_validation)
    assert result.plan is not None
    return result.plan


def quick_plan(capsys, source: Path, out: Path, *args: str) -> dict:
    code, stdout, _ = run_cli(capsys, "repack", str(source), str(out), "--dry-run", "--json", *args)
    assert code == 0, stdout
    return json.loads(stdout)


@pytest.mark.parametrize("name", ["plain", "mixed", "shared"])
@pytest.mark.parametrize("args, options", [
    ((), {}),
    (("--layers", "4"), {"layers": [4]}),
    (("--tp", "1", "--ranks", "0"), {"tp": 1, "ranks": [0]}),
    (("--experts-only",), {"copy_other": False}),
    (("--shared-h",), {"shared_h": True}),
])
def test_the_quick_plan_is_the_full_plan(capsys, sources, tmp_path, monkeypatch, name, args, options):
    expected = full_plan(sources[name], tmp_path / "pack", **options)

    def no_parse(*_a, **_k):
        raise AssertionError("a dry run of a local TR3 parses no header")
    monkeypatch.setattr(header, "parse_header", no_parse)
    plan = quick_plan(capsys, sources[name], tmp_path / "pack", *args)
    assert plan.pop("dry_run") is True
    expected_notes, notes = expected.pop("notes"), plan.pop("notes")
    assert expected_notes[0] in notes and any("the real run" in note for note in notes)
    plan.pop("free_bytes"), expected.pop("free_bytes")  # the filesystem moves between the two calls
    assert plan == expected
    assert list(tmp_path.iterdir()) == []


def test_an_inexact_tp_is_the_same_usage_error(capsys, sources, tmp_path):
    code, stdout, err = run_cli(capsys, "repack", str(sources["plain"]), str(tmp_path / "pack"), "--dry-run",
                                "--tp", "4")
    assert code == 2 and stdout == ""
    assert "--tp 4: 64 intermediate features per rank is not a multiple of 128" in err


def test_the_mixed_shard_is_carried_and_the_dense_one_copied(capsys, sources, tmp_path):
    plan = quick_plan(capsys, sources["mixed"], tmp_path / "pack")
    names = {f["name"]: f for f in plan["files"]}
    assert f"extra/{MIXED_SHARD}" in names and "model-dense.safetensors" in names
    assert names["model-dense.safetensors"]["bytes"] == (sources["mixed"] / "model-dense.safetensors").stat().st_size
    # The real run writes exactly the planned extra/ file and holds every planned byte.
    code, stdout, _ = run_cli(capsys, "repack", str(sources["mixed"]), str(tmp_path / "pack"), "--json")
    assert code == 0 and json.loads(stdout)["bytes_needed"] == plan["bytes_needed"]
    assert (tmp_path / "pack" / "extra" / MIXED_SHARD).stat().st_size == names[f"extra/{MIXED_SHARD}"]["bytes"]


def test_a_resumable_stage_is_counted_as_by_the_full_plan(capsys, sources, tmp_path, monkeypatch):
    from helpers import interrupt_after

    source, out = sources["plain"], tmp_path / "pack"
    interrupt_after(monkeypatch, 2)
    code, _, _ = run_cli(capsys, "repack", str(source), str(out), "--jobs", "1")
    assert code != 0 and Path(f"{out}.partial").is_dir()
    monkeypatch.undo()
    plan = quick_plan(capsys, source, out)
    assert plan["bytes_resumable"] > 0
    assert plan["bytes_resumable"] == full_plan(source, out)["bytes_resumable"]


def test_undeclared_k_falls_back_to_the_full_opening(capsys, sources, tmp_path):
    """Without tier_bitmap.json the K of each expert is known from the headers only: the full opening plans."""
    source = Path(shutil.copytree(sources["plain"], tmp_path / "nobitmap"))
    (source / "tier_bitmap.json").unlink()
    (source / "MANIFEST.sha256").unlink()
    plan = quick_plan(capsys, source, tmp_path / "pack")
    assert not any("the real run" in note for note in plan["notes"])
    expected = full_plan(source, tmp_path / "pack")
    plan.pop("dry_run"), plan.pop("free_bytes"), expected.pop("free_bytes")
    assert plan == expected


def test_the_quick_plan_at_production_geometry(capsys, tmp_path, monkeypatch):
    """Two layers of the glm52-tp4 preset (sparse): 12,288 tensors per shard, 192/64 K3/K4, TP4; 8 layer
    files, tier_bitmap.json copied, config.json and manifest.json."""
    import dataclasses

    from trellis_cli.synth import preset, write_checkpoint

    source = write_checkpoint(tmp_path / "glm", dataclasses.replace(preset("glm52-tp4"), layers=(3, 4), sparse=True))
    expected = full_plan(source, tmp_path / "pack")
    monkeypatch.setattr(header, "parse_header", lambda *_a, **_k: pytest.fail("a header was parsed"))
    plan = quick_plan(capsys, source, tmp_path / "pack")
    assert len(plan["files"]) == 2 * 4 + 3 and plan["bytes_needed"] > 7e9
    for doc in (plan, expected):
        doc.pop("free_bytes"), doc.pop("notes")
    plan.pop("dry_run")
    assert plan == expected


def test_a_real_run_is_refused_for_space_before_any_header_is_parsed(capsys, sources, tmp_path, monkeypatch):
    from trellis_cli.repack import staged_run

    monkeypatch.setattr(staged_run, "free_bytes", lambda _out: 1000)
    monkeypatch.setattr(header, "parse_header", lambda *_a, **_k: pytest.fail("a header was parsed"))
    code, stdout, err = run_cli(capsys, "repack", str(sources["mixed"]), str(tmp_path / "pack"))
    assert code == 1 and stdout == ""
    assert "0.00 GB free on its filesystem, the repack needs" in err
    assert list(tmp_path.iterdir()) == []


def _truncated_shard(root: Path) -> None:
    shard = root / "model-layer-004.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])


def _shard_linked_outside(root: Path) -> None:
    shard = root / "model-layer-004.safetensors"
    outside = root.parent / f"{root.name}-outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)


def _unreadable_bitmap(root: Path) -> None:
    (root / "tier_bitmap.json").write_text("{not json")


@pytest.mark.parametrize("damage", [_truncated_shard, _shard_linked_outside, _unreadable_bitmap])
def test_a_damaged_source_gets_the_answer_of_the_full_opening(capsys, sources, tmp_path, monkeypatch, damage):
    """Where the quick look cannot plan, the dry run says what opening the source in full says, word for word."""
    from trellis_cli.repack import run as repack_run

    source = Path(shutil.copytree(sources["plain"], tmp_path / "src"))
    (source / "MANIFEST.sha256").unlink()
    damage(source)
    args = ("repack", str(source), str(tmp_path / "pack"), "--dry-run", "--json")
    quick = run_cli(capsys, *args)
    monkeypatch.setattr(repack_run, "quick_dry_run", lambda *_a: None)
    full = run_cli(capsys, *args)
    strip = lambda text: re.sub(r'"free_bytes": [0-9]+', "", text)  # noqa: E731 - the filesystem moves
    assert (quick[0], strip(quick[1]), quick[2]) == (full[0], strip(full[1]), full[2])
    assert not (tmp_path / "pack").exists()


# ---- the quick plan equals the full plan, or defers to it, on every hostile source ------------------------------

def _dense_shard_quoting_an_expert(root: Path, tensors: int) -> None:
    """A non-expert shard whose __metadata__ quotes a routed-expert name (as a converter's note might)."""
    gen = torch.Generator().manual_seed(52)
    # names of their own: the tiny preset's model-non-expert.safetensors already holds every attention weight
    dense = {f"model.extra_dense.{i}.weight": torch.randn(256, 256, generator=gen).to(torch.bfloat16)
             for i in range(tensors)}
    save_file(dense, str(root / "model-dense.safetensors"),
              metadata={"format": "pt", "source": "model.layers.4.mlp.experts.0.gate_proj.rank0.trellis"})
    edit_json(root / "model.safetensors.index.json",
              lambda doc: doc["weight_map"].update(dict.fromkeys(dense, "model-dense.safetensors")))


def _metadata_quotes_an_expert(root: Path) -> None:
    _dense_shard_quoting_an_expert(root, 2)


def _metadata_quotes_an_expert_beside_one_tensor(root: Path) -> None:
    _dense_shard_quoting_an_expert(root, 1)


def _escaped_names(root: Path) -> None:
    """Layer 4's names written with a JSON escape (`\\u006dodel.layers.4...`): valid JSON, the same names."""
    from corrupt import SHARD4, read_header, write_header

    _, doc = read_header(root / SHARD4)
    text = json.dumps(doc, separators=(",", ":")).replace('"model.layers.4.', '"\\u006dodel.layers.4.')
    write_header(root / SHARD4, doc, text=text)


def _spaced_header(root: Path) -> None:
    """A header written with whitespace between its tokens (another writer's layout): the same tensors."""
    from corrupt import SHARD3, read_header, write_header

    _, doc = read_header(root / SHARD3)
    write_header(root / SHARD3, doc, text=json.dumps(doc, indent=1))


def _hostile_sources() -> dict:
    from corrupt import CORPUS, READER_CORPUS

    sources = {name: damage for name, (damage, _deep) in CORPUS.items()}
    sources.update(READER_CORPUS)
    sources.update({"metadata-quotes-an-expert": _metadata_quotes_an_expert,
                    "metadata-quotes-an-expert-beside-one-tensor": _metadata_quotes_an_expert_beside_one_tensor,
                    "escaped-names": _escaped_names, "spaced-header": _spaced_header,
                    **{f.__name__.strip("_"): f for f in (_truncated_shard, _shard_linked_outside,
                                                          _unreadable_bitmap)}})
    return sources


HOSTILE = _hostile_sources()


def _answer(capsys, *args: str) -> tuple:
    code, stdout, err = run_cli(capsys, *args)
    doc = json.loads(stdout) if code == 0 else None
    if doc is not None:
        doc.pop("free_bytes", None)  # the filesystem moves between the two calls
        doc.pop("notes", None)  # the quick plan says it planned from the declarations
    return code, doc, err


@pytest.mark.parametrize("args", [(), ("--layers", "4"), ("--experts-only",)], ids=["all", "layers-4", "experts"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_the_quick_plan_equals_or_defers_to_the_full_plan_on_hostile_sources(capsys, sources, tmp_path,
                                                                            monkeypatch, name, args):
    """Verdict, bytes and refusals: the dry run's answer is the full opening's, whatever the source holds."""
    from trellis_cli.repack import run as repack_run

    source = Path(shutil.copytree(sources["plain"], tmp_path / "src", symlinks=True))
    (source / "MANIFEST.sha256").unlink()
    HOSTILE[name](source)
    command = ("repack", str(source), str(tmp_path / "pack"), "--dry-run", "--json", *args)
    quick = _answer(capsys, *command)
    monkeypatch.setattr(repack_run, "quick_dry_run", lambda *_a: None)
    full = _answer(capsys, *command)
    assert quick == full
    assert not (tmp_path / "pack").exists()


@pytest.mark.parametrize("name", ["metadata-quotes-an-expert", "metadata-quotes-an-expert-beside-one-tensor",
                                  "escaped-names"])
def test_the_real_run_writes_what_the_quick_plan_planned(capsys, sources, tmp_path, name):
    """The quick plan's bytes are the real run's: a shard counted twice or dropped would refuse a repack for
    space it does not need, or promise space it lacks."""
    source = Path(shutil.copytree(sources["plain"], tmp_path / "src"))
    (source / "MANIFEST.sha256").unlink()
    HOSTILE[name](source)
    plan = quick_plan(capsys, source, tmp_path / "pack")
    code, stdout, err = run_cli(capsys, "repack", str(source), str(tmp_path / "pack"), "--json")
    assert code == 0, err
    assert json.loads(stdout)["bytes_needed"] == plan["bytes_needed"]
    written = sum(p.stat().st_size for p in (tmp_path / "pack").rglob("*") if p.is_file())
    assert written >= plan["bytes_needed"]


def test_escaped_names_are_the_names_they_spell(capsys, sources, tmp_path):
    source = Path(shutil.copytree(sources["plain"], tmp_path / "src"))
    (source / "MANIFEST.sha256").unlink()
    _escaped_names(source)
    assert run_cli(capsys, "validate", str(source))[0] == 0
    plan = quick_plan(capsys, source, tmp_path / "pack", "--layers", "4")
    assert plan["layers"] == "4"


def test_a_missing_shard_gets_the_real_answer_not_a_usage_error(capsys, sources, tmp_path):
    from corrupt import SHARD4

    source = Path(shutil.copytree(sources["plain"], tmp_path / "src"))
    (source / "MANIFEST.sha256").unlink()
    (source / SHARD4).unlink()
    code, _, err = run_cli(capsys, "repack", str(source), str(tmp_path / "pack"), "--layers", "4")
    assert code == 1 and "index.file-missing" in err


def test_a_lock_file_that_is_a_fifo_is_refused_by_the_dry_run_as_by_the_real_run(capsys, sources, tmp_path):
    import os

    out = tmp_path / "pack"
    os.mkfifo(tmp_path / "pack.partial.lock")
    dry = run_cli(capsys, "repack", str(sources["plain"]), str(out), "--dry-run")
    real = run_cli(capsys, "repack", str(sources["plain"]), str(out))
    assert dry[0] == real[0] == 2
    assert "pack.partial.lock: the lock file of" in dry[2] and "a FIFO, not a regular file" in dry[2]
    assert dry[2] == real[2]
