"""Bounded work and named refusals (issue 42, classes 9, 11 and 13): sizes declared by a few bytes of JSON or by
synth options are checked against named limits before anything loops or allocates; synth checks free space
first and never leaves OUT.partial behind a refusal; the messages name what they refuse; a closed pipe on
stdout ends a command quietly with its own exit code.

Each bounded case runs the real CLI in a subprocess under an address-space limit and a time limit.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import run_cli, error_line
from trellis_cli import synth
from trellis_cli.dialects.exl3v1.schema import MAX_EXPERTS, MAX_HIDDEN, MAX_SLOT_EXPERTS, MAX_SLOTS, UNIFORM, LayerEntry, Manifest
from trellis_cli.header_records import MAX_HEADER_TENSORS

REPO = Path(__file__).resolve().parents[2]
MEMORY_LIMIT = 4 << 30
SECONDS = 60  # the subprocess is killed here; the bound asserted is far lower


def run_limited(*args: str, stdout=subprocess.PIPE, stderr=subprocess.PIPE, file_limit: int | None = None
                ) -> tuple[subprocess.CompletedProcess, float]:
    """The real CLI in a subprocess under MEMORY_LIMIT of address space (and, as `ulimit -f`, `file_limit`
    bytes per file); (result, seconds)."""
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "trellis_cli", *args], stdout=stdout, stderr=stderr,
                          text=True, timeout=SECONDS, env={**os.environ, "PYTHONPATH": str(REPO)},
                          preexec_fn=limit_memory)
    return done, time.monotonic() - start


def assert_nothing_written(out: Path) -> None:
    assert not out.exists() and not out.with_name(out.name + ".partial").exists(), sorted(out.parent.iterdir())


# ---- class 9: synth sizes are checked before any work ---------------------------------------------------

@pytest.mark.parametrize("options, named", [
    (("--sparse", "--tp", "1000000", "--intermediate", "256000000"), f"above the limit of {MAX_HEADER_TENSORS:,}"),
    (("--sparse", "--experts", "1000000", "--uniform", "4", "--top-k", "2"), "tensors"),
    (("--sparse", "--format", "exl3-v1", "--experts", "1000000", "--uniform", "4", "--top-k", "2"), "experts"),
    (("--sparse", "--format", "exl3-v1", "--intermediate", str(1 << 32)), "slots"),
])
def test_synth_refuses_declared_sizes_above_the_limits_at_once(tmp_path, options, named):
    out = tmp_path / "out"
    done, seconds = run_limited("synth", str(out), *options)
    assert done.returncode == 2, done.stderr
    last = error_line(done.stderr)
    assert last.startswith("error: synth") and named in last and "limit" in last, done.stderr
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr
    assert seconds < 30, seconds
    assert_nothing_written(out)


# ---- class 9: exl3-v1 manifests declaring huge geometry -----------------------------------------------

def synth_exl3v1(tmp_path: Path, *options: str) -> Path:
    root = tmp_path / "exl3"
    status, _, err = run_cli(None, "synth", str(root), "--format", "exl3-v1", *options)
    assert status == 0, err
    return root


def edit_geometry(root: Path, **geometry) -> None:
    path = root / "exl3-manifest.json"
    doc = json.loads(path.read_text())
    doc["geometry"].update(geometry)
    path.write_text(json.dumps(doc))


def consistent_sparse_layer(root: Path, slots: int) -> Path:
    """A whole exl3-v1 checkpoint of one uniform K3 expert and `slots` slots, every header consistent, its data
    holes (hundreds of GB apparent, nothing on disk)."""
    from trellis_cli.dialects.exl3v1.write import layer_file_name, row_stride, write_layer, write_manifest
    from trellis_cli.dialects.exl3v1.layout import uniform_rates

    root.mkdir()
    m = Manifest(codebook="mcg", codebook_seed=0xCBAC1FED, num_experts=1, hidden=128, intermediate=32 * slots,
                 num_slots=slots, layer_indices=(3,), structure=UNIFORM, bits=3, pair_kinds=(),
                 intermediate_hadamard=False, per_expert_input_rotations=False, pre_block=None, post_block=None,
                 row_alignment=16, extent_alignment=4, barriers=())
    stride = row_stride(m, uniform_rates(3))
    path = write_layer(root / layer_file_name(3), m, 3, stride, lambda name: None, None)
    m.layers[3] = LayerEntry(path.name, "0" * 64)
    write_manifest(root, m, "exl3-manifest.json")
    return root


@pytest.mark.parametrize("shape", ["declared-2^40-slots", "consistent-sparse-2^27-slots", "pair-tables-2x128MiB"])
def test_exl3v1_geometry_above_the_limits_is_one_finding_in_bounded_time(tmp_path, shape):
    if shape == "declared-2^40-slots":
        root = synth_exl3v1(tmp_path)
        edit_geometry(root, num_slots=1 << 40, intermediate_size=32 << 40)
        code, field = "exl3v1.too-large", "geometry.num_slots"
    elif shape == "consistent-sparse-2^27-slots":
        root = consistent_sparse_layer(tmp_path / "exl3", 1 << 27)
        code, field = "exl3v1.too-large", "geometry.num_slots"
    else:  # rate tables of [num_slots/8, E] = 2^27 bytes each: the slot count is fine, the product is not
        root = synth_exl3v1(tmp_path, "--partition", "6/2")
        edit_geometry(root, num_slots=MAX_SLOTS // 2, intermediate_size=32 * MAX_SLOTS // 2, num_experts=1 << 17)
        code, field = "exl3v1.too-large", "geometry.num_experts"
    assert (root / "exl3-manifest.json").stat().st_size < 2000

    done, seconds = run_limited("validate", str(root), "--json")
    assert done.returncode == 1 and "Traceback" not in done.stderr and "internal error" not in done.stderr
    findings = json.loads(done.stdout)["findings"]
    assert [(f["code"], f["location"]["tensor"]) for f in findings] == [(code, field)], findings
    assert seconds < 30, seconds

    done, seconds = run_limited("inspect", str(root), "--json")
    assert done.returncode == 0 and "internal error" not in done.stderr, done.stderr
    assert seconds < 30, seconds


@pytest.mark.slow
def test_the_largest_geometry_within_the_limits_validates_in_bounded_time(tmp_path):
    slots = MAX_SLOT_EXPERTS // MAX_EXPERTS
    root = synth_exl3v1(tmp_path, "--sparse", "--experts", str(MAX_EXPERTS), "--intermediate", str(32 * slots),
                        "--partition", f"{MAX_EXPERTS - 1}/1", "--top-k", "2")
    for command in ("validate", "inspect"):
        done, seconds = run_limited(command, str(root), "--json")
        assert done.returncode == 0, done.stderr
        assert seconds < 30, (command, seconds)


# ---- class 11: synth checks free space first ----------------------------------------------------------

@pytest.mark.parametrize("fmt", ["tr3", "exl3-v1"])
def test_synth_refuses_by_name_when_the_filesystem_cannot_hold_it(tmp_path, fmt):
    from trellis_cli.dialects.exl3v1.synth import checkpoint_bytes as exl3v1_bytes

    free = shutil.disk_usage(tmp_path).free
    geometry = {"hidden": 128, "intermediate": 4096, "experts": 8}
    spec = synth.SynthSpec(tp=1, layers=(3,), uniform_k=4, top_k=2, **geometry)
    size = synth.checkpoint_bytes if fmt == "tr3" else exl3v1_bytes
    while size(spec) <= 4 * free:  # within the exl3-v1 limits up to several TB
        key = "hidden" if spec.hidden < MAX_HIDDEN else "experts"
        geometry[key] *= 2
        spec = synth.SynthSpec(tp=1, layers=(3,), uniform_k=4, top_k=2, **geometry)
    out = tmp_path / "out"
    options = [f"--{key}={value}" for key, value in geometry.items()]
    # The file-size limit keeps a synth that does not check first from filling the disk: it fails on EFBIG.
    done, seconds = run_limited("synth", str(out), "--format", fmt, *options, "--tp", "1", "--layers", "3",
                                "--uniform", "4", "--top-k", "2", file_limit=256 << 20)
    assert done.returncode == 1, done.stderr
    last = error_line(done.stderr)
    assert last.startswith(f"error: {out}: ") and "GB free on its filesystem" in last and "needs" in last, last
    assert seconds < 30, seconds
    assert_nothing_written(out)


def test_sparse_synth_needs_no_room_for_its_holes(tmp_path, capsys):
    status, _, err = run_cli(capsys, "synth", str(tmp_path / "out"), "--sparse", "--preset", "glm52-tp4",
                             "--layers", "3")
    assert status == 0, err


# ---- class 13: messages that name what they refuse ----------------------------------------------------

@pytest.mark.parametrize("fmt", ["tr3", "exl3-v1"])
def test_synth_overwrite_through_a_symlinked_out_is_refused_by_name(tmp_path, capsys, fmt):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("not synth's")
    out = tmp_path / "out"
    out.symlink_to(target)
    status, _, err = run_cli(capsys, "synth", str(out), "--format", fmt, "--overwrite")
    assert status == 2 and err.count("error:") == 1, err
    assert f"{out} (OUT) is a symbolic link" in err and "rmtree" not in err
    assert (target / "keep.txt").read_text() == "not synth's" and out.is_symlink()
    assert not out.with_name("out.partial").exists()


def test_synth_staging_directory_that_is_a_link_is_refused_by_name(tmp_path, capsys):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    (tmp_path / "out.partial").symlink_to(target)
    status, _, err = run_cli(capsys, "synth", str(tmp_path / "out"))
    assert status == 2 and "out.partial (the staging directory of OUT) is a symbolic link" in err, err
    assert (target / "keep.txt").read_text() == "x" and not (tmp_path / "out").exists()


def test_a_fifo_as_the_repack_lock_is_refused_by_name(tmp_path, capsys):
    source = synth.write_checkpoint(tmp_path / "src", synth.preset("tiny"))
    out = tmp_path / "out"
    os.mkfifo(tmp_path / "out.partial.lock")
    done, seconds = run_limited("repack", str(source), str(out))
    assert done.returncode == 2, done.stderr
    last = error_line(done.stderr)
    assert last == (f"error: {out}.partial.lock: the lock file of {out} is a FIFO, not a regular file; remove it "
                    "and rerun"), last
    assert seconds < 30 and not out.exists()


def closed_pipe_run(*args: str) -> subprocess.CompletedProcess:
    """`trellis ARGS | head -c 0`, deterministically: stdout is a pipe whose reader is already gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done, _ = run_limited(*args, stdout=write_end)
    finally:
        os.close(write_end)
    return done


@pytest.mark.parametrize("as_json", [False, True])
def test_a_reader_that_leaves_ends_the_command_quietly_with_its_own_code(tmp_path, as_json):
    extra = ("--json",) if as_json else ()
    done = closed_pipe_run("inspect", *extra)
    assert done.returncode == 0 and "error" not in done.stderr and "Exception" not in done.stderr, done.stderr

    broken = synth.write_checkpoint(tmp_path / "src", synth.preset("tiny"))
    (broken / "tier_bitmap.json").write_text("[]")
    done = closed_pipe_run("validate", str(broken), *extra)  # its verdict, not the pipe's
    assert done.returncode == 1 and "Exception" not in done.stderr, done.stderr


def test_a_reader_of_both_streams_that_leaves_changes_no_exit_code(tmp_path):
    """`trellis validate ... 2>&1 | head -c 1`: stderr's writes hit the closed pipe too."""
    broken = synth.write_checkpoint(tmp_path / "src", synth.preset("tiny"))
    (broken / "tier_bitmap.json").write_text("[]")
    for args, code in ((("validate",), 0), (("validate", str(broken)), 1), (("inspect", str(tmp_path / "no")), 3)):
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            done, _ = run_limited(*args, stdout=write_end, stderr=write_end)
        finally:
            os.close(write_end)
        assert done.returncode == code, args


@pytest.mark.parametrize("edit, code", [
    (lambda doc: doc["layers"].update({"9" * 5000: doc["layers"]["3"]}), "exl3v1.layer-key"),
    (lambda doc: doc["geometry"].update(moe_layer_indices=[3, 4, 1 << 20]), "exl3v1.geometry"),
    (lambda doc: doc["geometry"].update(num_experts=10 ** 5000), "checkpoint.unreadable"),
])
def test_exl3v1_numbers_beyond_any_layer_or_int_conversion_are_named(capsys, tmp_path, edit, code):
    root = synth_exl3v1(tmp_path)
    path = root / "exl3-manifest.json"
    doc = json.loads(path.read_text())
    edit(doc)
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # only to write the file
    try:
        path.write_text(json.dumps(doc))
    finally:
        sys.set_int_max_str_digits(limit)
    capsys.readouterr()
    status, out, err = run_cli(capsys, "validate", str(root), "--json")
    assert status == 1 and "internal error" not in err, err
    assert code in {f["code"] for f in json.loads(out)["findings"]}
    status, _, err = run_cli(capsys, "inspect", str(root))
    assert status in (0, 1) and "internal error" not in err, err
