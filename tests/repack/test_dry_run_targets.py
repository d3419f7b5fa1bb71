"""`repack --dry-run` for every target is the driver's plan: the sizes the real run then needs and writes, the
free space, and the refusals the real run makes (mixed K that exl3-v1 cannot declare, a disk too small for a
re-slice), in the real run's words."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_cli
from trellis_cli.synth import SynthSpec, write_checkpoint

# TP2, 512 channels: re-sliced exactly to TP4 (128 channels a rank); mixed K, so exl3-v1 needs whole 256-channel
# pairs per rank, which 256 channels a rank give (per-rank hidden vectors: refused later, on the data).
RESLICE = SynthSpec(hidden=256, intermediate=512, experts=4, tp=2, layers=(3, 4), partition=(3, 1), top_k=2)
# TP2, 256 channels: 128 a rank, not one whole pair: `--to exl3-v1` is refused before any work.
NO_PAIRS = SynthSpec(hidden=256, intermediate=256, experts=4, tp=2, layers=(3,), partition=(3, 1), top_k=2)
# TP1, mixed K, 1024 channels: converts to exl3-v1.
TO_EXL3V1 = SynthSpec(hidden=256, intermediate=1024, experts=4, tp=1, layers=(3,), partition=(3, 1), top_k=2)


def dry_json(capsys, source: Path, out: Path, *args: str) -> dict:
    code, stdout, err = run_cli(capsys, "repack", str(source), str(out), "--dry-run", "--json", *args)
    assert code == 0, err
    plan = json.loads(stdout)
    assert plan["dry_run"] is True and plan["refusals"] == [] and plan["space_ok"] is True
    return plan


def real_json(capsys, source: Path, out: Path, *args: str) -> dict:
    code, stdout, err = run_cli(capsys, "repack", str(source), str(out), "--json", *args)
    assert code == 0, err
    return json.loads(stdout)


def written(out: Path) -> dict[str, int]:
    return {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}


def assert_plan_is_what_was_written(plan: dict, summary: dict, out: Path) -> None:
    """Every file named, exact sizes exact, and the free space the plan asked for enough for what was written
    (`bytes_planned`: a size known within a header's names, or an exl3-v1 file planned at its source's size)."""
    from trellis_cli.disk_space import HEADROOM_BYTES

    files = written(out)
    assert summary["bytes_needed"] == plan["bytes_needed"] > 0
    assert sum(files.values()) <= plan["bytes_needed"] + HEADROOM_BYTES
    assert {f["name"] for f in plan["files"]} == set(files)
    for f in plan["files"]:
        if "bytes" in f:
            assert files[f["name"]] == f["bytes"], f
        if "data_bytes" in f:  # a layer file: its tensor data, then a header of a few KB
            assert 0 < files[f["name"]] - f["data_bytes"] < 64 << 10, f


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    from helpers import exl3v1_specs
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    base = tmp_path_factory.mktemp("targets")
    made = {"reslice": write_checkpoint(base / "reslice", RESLICE),
            "no-pairs": write_checkpoint(base / "no-pairs", NO_PAIRS),
            "to-exl3v1": write_checkpoint(base / "to-exl3v1", TO_EXL3V1),
            "exl3v1": write_exl3v1_checkpoint(base / "exl3v1", exl3v1_specs()["pair-per-expert"])}
    for name, source, args in (("pack", "reslice", ()), ("btx", "exl3v1", ("--to", "btx"))):
        assert run_cli(None, "repack", str(made[source]), str(base / name), *args)[0] == 0
        made[name] = base / name
    return made


@pytest.mark.parametrize("source, args, conversion", [
    ("reslice", ("--to", "tr3", "--tp", "4"), "tr3/per_expert_v1 -> tr3"),
    ("reslice", ("--tp", "4"), "tr3/per_expert_v1 -> route-pack"),
    ("to-exl3v1", ("--to", "exl3-v1"), "tr3/per_expert_v1 -> exl3-v1"),
    ("exl3v1", ("--tp", "2"), "exl3-v1 -> route-pack"),
    ("exl3v1", ("--to", "tr3", "--tp", "2"), "exl3-v1 -> tr3"),
    ("exl3v1", ("--to", "btx"), "exl3-v1 -> btx"),
    ("btx", ("--to", "exl3-v1"), "btx-atoms-v1 -> exl3-v1"),
    ("pack", ("--to", "tr3"), "route-pack -> tr3"),
], ids=lambda v: v if isinstance(v, str) else "-".join(v))
def test_every_targets_dry_run_plans_what_the_real_run_writes(capsys, sources, tmp_path, source, args, conversion):
    plan = dry_json(capsys, sources[source], tmp_path / "out", *args)
    assert plan["conversion"] == conversion and plan["free_bytes"] > 0
    assert list(tmp_path.iterdir()) == []  # nothing written, not even the lock file
    summary = real_json(capsys, sources[source], tmp_path / "out", *args)
    assert_plan_is_what_was_written(plan, summary, tmp_path / "out")


@pytest.mark.parametrize("args", [("--to", "tr3", "--tp", "4"), ("--to", "exl3-v1")], ids=["tr3-tp4", "exl3-v1"])
def test_each_dry_run_prints_its_sizes(capsys, sources, tmp_path, args):
    source = sources["reslice" if "tr3" in args else "to-exl3v1"]
    code, stdout, err = run_cli(capsys, "repack", str(source), str(tmp_path / "out"), "--dry-run", *args)
    assert code == 0, err
    assert "GB to hold" in stdout and "known once" not in stdout and "(enough)" in stdout
    assert "files     " in stdout


def test_tr3_tp_dry_run_refuses_too_little_space_as_the_real_run_does(capsys, sources, tmp_path, monkeypatch):
    from trellis_cli.repack import staged_run

    monkeypatch.setattr(staged_run, "free_bytes", lambda _out: 1000)  # a nearly full filesystem
    args = ("--to", "tr3", "--tp", "4")
    code, stdout, err = run_cli(capsys, "repack", str(sources["reslice"]), str(tmp_path / "out"), "--dry-run", *args)
    assert code == 1 and "(NOT enough)" in stdout
    assert "error: dry run: a real run would be refused: " in err
    refusal = err.split("a real run would be refused: ", 1)[1].strip()
    assert "0.00 GB free on its filesystem, the repack needs" in refusal
    real = run_cli(capsys, "repack", str(sources["reslice"]), str(tmp_path / "out"), *args)
    assert real[0] == 1 and refusal in real[2]
    assert list(tmp_path.iterdir()) == []


def test_exl3v1_dry_run_refuses_mixed_k_without_pairs_as_the_real_run_does(capsys, sources, tmp_path):
    dry = run_cli(capsys, "repack", str(sources["no-pairs"]), str(tmp_path / "out"), "--dry-run", "--to", "exl3-v1")
    real = run_cli(capsys, "repack", str(sources["no-pairs"]), str(tmp_path / "out"), "--to", "exl3-v1")
    assert dry[0] == real[0] == 2 and dry[1] == ""
    assert "mixed K [3, 4] needs per_expert_pair rates" in dry[2]
    assert dry[2].splitlines()[-1] == real[2].splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_exl3v1_dry_run_refuses_per_rank_hidden_vectors_as_the_real_run_does(capsys, sources, tmp_path):
    """The one refusal that reads data (each rank's hidden-side vectors must be equal): the dry run reads them."""
    dry = run_cli(capsys, "repack", str(sources["reslice"]), str(tmp_path / "out"), "--dry-run", "--to", "exl3-v1")
    real = run_cli(capsys, "repack", str(sources["reslice"]), str(tmp_path / "out"), "--to", "exl3-v1")
    assert dry[0] == real[0] == 1 and "exl3v1.h-side-differs" in dry[2]
    assert dry[2].splitlines()[-1] == real[2].splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_a_real_run_writes_by_the_plan_of_its_driver(sources, tmp_path):
    """One plan per run: the staged run writes what `plan()` said, and never plans twice."""
    from trellis_cli.repack import staged_run
    from trellis_cli.repack.run import RepackOptions, run_repack
    from trellis_cli.validate import run_validation

    plans = []
    original = staged_run.Driver.planned

    def counted(self):
        plans.append(self)
        return original(self)

    staged_run.Driver.planned = counted  # type: ignore[method-assign]
    try:
        run_repack(sources["reslice"], tmp_path / "out", RepackOptions(to="tr3", tp=4), validator=run_validation)
    finally:
        staged_run.Driver.planned = original  # type: ignore[method-assign]
    assert len({id(d) for d in plans}) == 1


def test_every_row_of_the_conversion_table_has_a_driver_and_every_driver_a_row():
    """Each row's driver is named by its target dialect's `drivers` and made by a factory that exists; no dialect
    names a driver no row uses."""
    from trellis_cli.dialects import registry
    from trellis_cli.repack.drivers import factory_of

    rows = registry.conversions()
    assert all(row.factory for row in rows), [row.driver for row in rows if not row.factory]
    assert all(callable(factory_of(row)) for row in rows)
    named = {name for d in registry.DIALECTS for name in d.drivers}
    assert named == {row.driver for row in rows}


def test_the_quick_plan_is_asked_of_the_driver_and_no_driver_name_is_compared():
    """Which conversions are planned from the declarations, before the opening, is said by the driver object
    (`Driver.plans_from_declarations`): TR3 -> route pack alone. No module of repack/ spells a driver's name or
    names a driver's module."""
    import trellis_cli.repack
    from trellis_cli.checkpoint.model import DIALECT_TR3_PER_EXPERT, DIALECT_TR3_SHARED_H
    from trellis_cli.dialects import registry
    from trellis_cli.repack.drivers import quick_planner
    from trellis_cli.dialects.routepack.tr3_to_route_pack import Tr3ToRoutePack

    rows = registry.conversions()
    quick = {(row.source, row.target) for row in rows if quick_planner(row.source, row.target) is not None}
    assert quick == {(DIALECT_TR3_PER_EXPERT, "route-pack"), (DIALECT_TR3_SHARED_H, "route-pack")}
    assert quick_planner(DIALECT_TR3_PER_EXPERT, "route-pack") is Tr3ToRoutePack
    assert quick_planner(DIALECT_TR3_PER_EXPERT, "no-such-target") is None
    package = Path(trellis_cli.repack.__file__).parent
    named = [f"{p.name}: {row.driver}" for p in sorted(package.glob("*.py"))
             for row in rows if f'"{row.driver}"' in p.read_text(encoding="utf-8")
             or row.factory.partition(":")[0] in p.read_text(encoding="utf-8")]
    assert not named


@pytest.mark.parametrize("spelled", ["routepack", "route_pack", "Route-Pack"])
def test_a_target_spelled_another_way_is_refused_naming_the_word(capsys, sources, tmp_path, spelled):
    """`--to routepack`: the library's refusal and the CLI's say the word to use. Nothing is written either way."""
    from trellis_cli import RepackOptions, run_repack
    from trellis_cli.errors import UsageError

    out = tmp_path / "out"
    with pytest.raises(UsageError, match=r"did you mean --to route-pack\?"):
        run_repack(sources["reslice"], out, RepackOptions(to=spelled))
    code, _, err = run_cli(capsys, "repack", str(sources["reslice"]), str(out), "--to", spelled)
    assert code == 2 and "did you mean --to route-pack?" in err
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.slow
def test_the_re_slice_fit_recommends_is_planned_at_production_size(capsys, glm52_tp4_sparse, tmp_path, monkeypatch):
    """`repack --to tr3 --tp 8 --dry-run` on the production shape: ~300 GB planned; 59 GB free is refused."""
    from trellis_cli.repack import staged_run

    monkeypatch.setattr(staged_run, "free_bytes", lambda _out: 59 * 10**9)
    args = ("repack", str(glm52_tp4_sparse), str(tmp_path / "out"), "--to", "tr3", "--tp", "8", "--dry-run")
    code, stdout, err = run_cli(capsys, *args, "--json")
    plan = json.loads(stdout)
    assert code == 1 and plan["tp"] == 8 and plan["space_ok"] is False
    # 76 shards at TP8, tier_bitmap.json copied, config.json, the index and MANIFEST.sha256 written
    assert plan["bytes_needed"] > 290e9 and len(plan["files"]) == 76 + 4
    assert "59.00 GB free on its filesystem, the repack needs" in err
    assert list(tmp_path.iterdir()) == []
