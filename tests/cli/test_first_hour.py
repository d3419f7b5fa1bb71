"""A new user's first hour (issue 44): complete JSON, Ctrl-C and resume said plainly, refusals before the slow
part, `repack --dry-run`, clear messages, one unit convention, help that reads as conventions."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import interrupt_after, many_findings_checkpoint, run_cli, tiny_checkpoint, without_hint


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    return many_findings_checkpoint(tmp_path_factory.mktemp("many") / "zeros")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


# ---- 1: --json carries every finding ---------------------------------------------------------------

def test_validate_json_carries_every_finding(capsys, many):
    code, out, _ = run_cli(capsys, "validate", str(many), "--deep", "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["ok"]
    assert doc["counts"]["by_code"]["data.zero-vector"] == {"error": 12288}
    findings = doc["findings"]
    assert len(findings) == sum(doc["counts"][s] for s in ("error", "warning", "info")) > 10_000
    zero = [f for f in findings if f["code"] == "data.zero-vector"]
    assert len(zero) == 12288
    where = {(f["location"]["layer"], f["location"]["expert"], f["location"].get("projection"),
              f["location"].get("rank"), f["location"].get("tensor")) for f in zero}
    assert len(where) == 12288  # each one a different vector, none repeated
    # Numbers sort as numbers: expert 2 comes before expert 10.
    experts = [f["location"]["expert"] for f in zero if f["location"]["layer"] == 3]
    assert experts == sorted(experts)


def test_the_human_view_stays_capped_with_counts_per_code(capsys, many):
    code, out, err = run_cli(capsys, "validate", str(many), "--deep")
    assert code == 1
    listed = [line for line in out.splitlines() if line.startswith("error[data.zero-vector] model.")]
    assert 0 < len(listed) <= 50
    assert (f"error[data.zero-vector] ... and {12288 - len(listed)} more data.zero-vector finding(s) not listed "
            "(12288 in all)") in out
    # The FAIL verdict is said once: on stdout, not again on stderr.
    assert sum("FAIL" in line for line in (out + err).splitlines()) == 1


def test_every_json_document_parses_on_a_checkpoint_with_many_findings(capsys, many, tmp_path):
    code, out, _ = run_cli(capsys, "inspect", str(many), "--json")
    assert code == 0 and json.loads(out)["layers"]
    code, out, err = run_cli(capsys, "repack", str(many), str(tmp_path / "pack"), "--json", "--layers", "99")
    assert code == 2 and out == ""  # a usage error before anything: no document to give
    code, out, _ = run_cli(capsys, "repack", str(many), str(tmp_path / "pack"), "--json", "--dry-run")
    doc = json.loads(out)
    assert code == 0 and doc["dry_run"] and len(doc["files"]) == 4 * 2 + 4  # layer files, copied files (the other weights, the bitmap), config, manifest
    code, out, _ = run_cli(capsys, "synth", str(tmp_path / "s"), "--preset", "tiny", "--sparse", "--json")
    assert code == 0 and json.loads(out)


def test_fit_and_diff_json_parse_on_a_checkpoint_with_many_findings(capsys, many):
    code, out, err = run_cli(capsys, "fit", str(many), "--tp", "2", "--gpu", "h200", "--json")
    assert code == 0 and json.loads(out)["tp"] == 2, err
    code, out, err = run_cli(capsys, "diff", str(many), str(many), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["identical"] and doc["layers_compared"], err


@pytest.mark.slow
def test_bench_json_on_the_cpu_parses_on_a_checkpoint_with_many_findings(capsys, many):
    code, out, err = run_cli(capsys, "bench", str(many), "--tp", "2", "--device", "cpu", "--smoke", "--json")
    doc = json.loads(out)
    assert code == 0, err
    assert doc["tp"] == 2 and doc["device"] == "cpu" and doc["checks"] and doc["passed"]


def test_a_refused_repack_gives_every_finding_in_json(capsys, tmp_path):
    source = many_findings_checkpoint(tmp_path / "bad")
    bitmap = json.loads((source / "tier_bitmap.json").read_text())
    for layer in bitmap.values():  # every expert declared at the other K than its tensors hold
        layer["k"] = [7 - k for k in layer["k"]]
    (source / "tier_bitmap.json").write_text(json.dumps(bitmap))
    code, out, err = run_cli(capsys, "repack", str(source), str(tmp_path / "pack"), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["refused"] and not doc["ok"]
    assert len(doc["findings"]) == sum(doc["counts"][s] for s in ("error", "warning", "info")) > 1000
    assert not (tmp_path / "pack").exists()


# ---- 2: Ctrl-C says where the stage is, and a rerun says what it resumes or discards -----------------

def test_ctrl_c_names_the_stage_and_the_same_command_resumes(capsys, tiny, tmp_path, monkeypatch):
    out = tmp_path / "pack"
    with monkeypatch.context() as patch:
        interrupt_after(patch, 2, KeyboardInterrupt)
        code, _, err = run_cli(capsys, "repack", str(tiny), str(out), "--jobs", "1")
    assert code == 130
    stage = f"{out}.partial"
    assert f"{stage} keeps 2 verified file(s)" in err and "rerun the same command to resume" in err
    assert err.splitlines()[-1] == "interrupted (Ctrl-C)"
    code, stdout, err = run_cli(capsys, "repack", str(tiny), str(out), "--jobs", "1")
    assert code == 0
    assert f"resuming {stage}: 2 file(s)" in err and "2 resumed" in stdout


def test_a_rerun_with_other_options_says_why_it_starts_over(capsys, tiny, tmp_path, monkeypatch):
    out = tmp_path / "pack"
    with monkeypatch.context() as patch:
        interrupt_after(patch, 1, KeyboardInterrupt)
        assert run_cli(capsys, "repack", str(tiny), str(out), "--jobs", "1")[0] == 130
    code, stdout, err = run_cli(capsys, "repack", str(tiny), str(out), "--jobs", "1", "--layers", "3")
    assert code == 0 and "0 resumed" in stdout
    assert f"not resuming {out}.partial: 1 staged file(s)" in err
    assert "other options (layers: None then, '3' now)" in err


# ---- 3: refusals before the slow part; --dry-run ------------------------------------------------------

def test_dry_run_writes_nothing_and_matches_a_real_run(capsys, tiny, tmp_path):
    out = tmp_path / "pack"
    code, stdout, _ = run_cli(capsys, "repack", str(tiny), str(out), "--dry-run", "--json")
    plan = json.loads(stdout)
    assert code == 0 and not out.exists() and not Path(f"{out}.partial").exists()
    assert list(tmp_path.iterdir()) == []
    assert plan["conversion"].endswith("-> route-pack") and plan["space_ok"] and plan["refusals"] == []
    assert plan["free_bytes"] > 0 and plan["bytes_resumable"] == 0
    code, stdout, _ = run_cli(capsys, "repack", str(tiny), str(out), "--json")
    summary = json.loads(stdout)
    assert code == 0 and summary["bytes_needed"] == plan["bytes_needed"]
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert {f["name"] for f in plan["files"]} == written
    for f in plan["files"]:
        size = (out / f["name"]).stat().st_size
        if "bytes" in f:
            assert size == f["bytes"], f
        if "data_bytes" in f:  # a layer file: its tensor data, then a header of a few KB
            assert 0 < size - f["data_bytes"] < 64 << 10, f


def test_dry_run_reports_the_space_refusal(capsys, tiny, tmp_path, monkeypatch):
    from trellis_cli.repack import staged_run

    monkeypatch.setattr(staged_run, "free_bytes", lambda _out: 1000)  # a nearly full filesystem
    code, stdout, err = run_cli(capsys, "repack", str(tiny), str(tmp_path / "pack"), "--dry-run")
    assert code == 1 and "(NOT enough)" in stdout
    assert "error: dry run: a real run would be refused:" in err and "0.00 GB free" in err
    assert list(tmp_path.iterdir()) == []


def test_space_and_out_are_refused_before_the_source_is_validated(tiny, tmp_path, monkeypatch):
    from trellis_cli.errors import CheckFailed, UsageError
    from trellis_cli.repack import run as repack_run
    from trellis_cli.validate import run_validation

    validated = []

    def validator(checkpoint):
        validated.append(checkpoint)
        return run_validation(checkpoint)

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UsageError, match="exists and is not empty"):
        repack_run.run_repack(tiny, tmp_path / "full", validator=validator)
    with pytest.raises(UsageError, match="--ranks"):
        repack_run.run_repack(tiny, tmp_path / "pack", repack_run.RepackOptions(ranks="7"), validator=validator)
    from trellis_cli.repack import staged_run

    monkeypatch.setattr(staged_run, "free_bytes", lambda _out: 1000)
    with pytest.raises(CheckFailed, match="GB free on its filesystem"):
        repack_run.run_repack(tiny, tmp_path / "pack", validator=validator)
    assert validated == [] and not (tmp_path / "pack").exists()


# ---- 5: messages that say what to do ------------------------------------------------------------------

def test_cpu_check_without_tp_says_to_pass_the_checkpoints_tp(capsys, tiny):
    code, out, err = run_cli(capsys, "bench", str(tiny), "--smoke", "--device", "cpu")
    assert code == 2 and out == ""
    assert "without --tp the layer runs as one rank" in err and "pass --tp 2" in err
    assert "--tp 1 merges" not in err


def test_synth_scales_the_presets_partition_to_experts(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "synth", str(tmp_path / "s"), "--experts", "64", "--sparse", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["experts"] == 64
    assert {json.dumps(p, sort_keys=True) for p in doc["partitions"].values()} == {'{"K3": 48, "K4": 16}'}


def test_synth_refuses_an_existing_directory_before_saying_it_writes(capsys, tiny):
    code, out, err = run_cli(capsys, "synth", str(tiny))
    assert code == 2 and out == ""
    assert without_hint(err).splitlines() == [f"error: synth: {tiny} exists and is not empty (pass --overwrite to replace it)"]


def test_deep_on_a_sparse_synth_says_why_the_data_is_zero(capsys, many):
    _, out, _ = run_cli(capsys, "validate", str(many), "--deep", "--layers", "3")
    assert "`trellis synth --sparse` wrote this checkpoint with headers only" in out
    _, out, _ = run_cli(capsys, "validate", str(many), "--layers", "3")
    assert "trellis synth --sparse" not in out  # no data read, no zero vectors, nothing to explain


# ---- 6: numbers that agree -----------------------------------------------------------------------------

def test_inspect_and_validate_count_a_route_packs_files_alike(capsys, tiny, tmp_path):
    pack = tmp_path / "pack"
    assert run_cli(capsys, "repack", str(tiny), str(pack))[0] == 0
    on_disk = sum(1 for p in pack.rglob("*") if p.is_file())
    _, out, _ = run_cli(capsys, "inspect", str(pack), "--json")
    assert json.loads(out)["route_pack"]["files"] == on_disk
    _, out, _ = run_cli(capsys, "validate", str(pack), "--json")
    assert json.loads(out)["checked"]["files"] == on_disk


def test_one_unit_convention_and_counts_that_agree_in_number(capsys, many):
    _, out, _ = run_cli(capsys, "inspect", str(many))
    assert "GiB" not in out and "MiB" not in out and " GB" in out or " MB" in out
    _, out, _ = run_cli(capsys, "validate", str(many), "--layers", "3")
    assert "checked" in out and " 1 layer," in out and "1 layers" not in out


def test_zero_rows_are_not_called_shareable(capsys, many):
    _, out, _ = run_cli(capsys, "validate", str(many), "--deep", "--layers", "3", "--json")
    codes = {f["code"] for f in json.loads(out)["findings"]}
    assert "data.zero-vector" in codes and "data.h-shareable" not in codes


# ---- 7: help and conventions ---------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["inspect", "validate", "repack", "bench", "synth"])
def test_help_shows_no_bool_type_and_names_arguments_in_capitals(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0 and "<bool>" not in out
    usage = next(line for line in out.splitlines() if "Usage:" in line)
    arguments = [word.strip("[]") for word in usage.split("[OPTIONS]", 1)[1].split()]
    assert arguments and all(re.fullmatch(r"[A-Z_]+", name) for name in arguments), usage  # SOURCE OUT: not {out}


def test_top_level_help_lists_exit_130_and_offers_completion(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "130 interrupted" in out and "--install-completion" in out and "<bool>" not in out


# ---- 4: every long phase shows what it does and how far it is -----------------------------------------

@pytest.mark.parametrize("argv", [["inspect"], ["validate", "--deep"], ["repack"]])
def test_long_phases_show_their_stage_and_count(capsys, many, tmp_path, terminal, argv):
    command, *rest = argv
    extra = [str(tmp_path / "pack"), "--layers", "3"] if command == "repack" else []
    code, _, err = run_cli(capsys, command, str(many), *extra, *rest)
    assert code == (1 if command == "validate" else 0), err
    drawn = terminal.getvalue()
    assert "reading headers (files)" in drawn and "5/5" in drawn  # 5 shards: 4 layers and the other weights
    assert "building the checkpoint model (steps)" in drawn and "5/5" in drawn
    assert "0/?" not in drawn
    if command == "validate":
        assert "header rules (layers)" in drawn and "data rules (layers)" in drawn
    if command == "repack":
        assert "header rules (layers)" in drawn and "repack (bytes)" in drawn


def test_to_exl3v1_refuses_space_before_validating(tmp_path, monkeypatch):
    from trellis_cli.errors import CheckFailed
    from trellis_cli.repack import staged_run
    from trellis_cli.repack.run import RepackOptions, run_repack

    source = tiny_checkpoint(tmp_path, tp=1, intermediate=1024)
    validated = []
    monkeypatch.setattr(staged_run, "free_bytes", lambda _out: 1000)
    with pytest.raises(CheckFailed, match="GB free on its filesystem"):
        run_repack(source, tmp_path / "v1", RepackOptions(to="exl3-v1"), validator=validated.append)
    assert validated == [] and not (tmp_path / "v1").exists()
