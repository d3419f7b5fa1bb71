"""`trellis bench --compare exllamav3` without a GPU: its usage errors, the skip when the peer is missing or
of another release, the peer's per-tier tensors (the checkpoint's own linears) and routes (per-tier calls sum
to the layer), and the table/JSON pieces. The timed run is in test_bench_compare_gpu.py."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import cuda_available
from helpers import run_cli
from trellis_cli.bench.peer_compare import disagreements
from trellis_cli.bench.peer_exllamav3 import PEER_VERSION, locate_peer, package_shell, split_routes, tier_experts
from trellis_cli.bench.smoke import rel_l2
from trellis_cli.bench.synthetic import Preset, random_activations, random_routes, synthetic_pack
from trellis_cli.dialects import open_checkpoint
from trellis_cli.bench.run import peer_summary
from trellis_cli.cli.bench_compare import compare_cells, compare_columns
from trellis_cli.reference import layer_pack_forward, moe_forward
from trellis_cli.dialects.shard_pack import pack_layer
from trellis_cli.sample import sample_path

SMALL = Preset("small", 256, 128, 16, 4, "mcg", (12, 4), (3, 4), 1)
ROOT = Path(__file__).resolve().parents[2]
PEER_MISSING = isinstance(locate_peer(), str)


@pytest.mark.parametrize("argv, message", [
    (["--compare", "vllm"], "--compare 'vllm': known peers are exllamav3"),
    (["--compare", "exllamav3", "--smoke"], "does not combine with --smoke"),
    (["--compare", "exllamav3", "--mixed-gap"], "does not combine with --smoke, --mixed-gap"),
    (["--compare", "exllamav3", "--tp", "2"], "--tp"),
    (["--compare", "exllamav3", "--compile-only"], "--compare applies to a throughput run"),
])
def test_compare_usage_errors_come_before_any_gpu_check(capsys, argv, message):
    code, _, err = run_cli(capsys, "bench", "--synthetic", "glm52-tp4", *argv)
    assert code == 2 and message in err


@pytest.mark.skipif(not PEER_MISSING or cuda_available(), reason="exllamav3 importable, or a GPU would run the bench")
def test_a_missing_peer_is_one_line_on_stderr_then_the_run_goes_on(capsys):
    code, out, err = run_cli(capsys, "bench", "--synthetic", "glm52-tp4", "--compare", "exllamav3", "--m", "1")
    line = (f"exllamav3 not importable: exllamav3 is not installed (pip install exllamav3=={PEER_VERSION}); "
            "skipping the comparison")
    assert line in err.replace("\n", " ") and out == ""
    assert code == 4 and "no CUDA GPU visible" in err  # our own run, not the comparison, stops here


@pytest.mark.skipif(cuda_available(), reason="a GPU would run the bench")
def test_another_release_of_the_peer_is_skipped_without_importing_it(tmp_path):
    package = tmp_path / "exllamav3"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")
    info = tmp_path / "exllamav3-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: exllamav3\nVersion: 1.0.0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run([sys.executable, "-m", "trellis_cli", "bench", "--synthetic", "glm52-tp4", "--compare",
                           "exllamav3"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 4, done.stderr
    assert (f"exllamav3 not importable: exllamav3 1.0.0 is installed; this comparison calls {PEER_VERSION}"
            in done.stderr.replace("\n", " "))


def test_a_package_shell_imports_submodules_and_can_still_be_located(tmp_path, monkeypatch):
    # The peer's MoE layer is imported under shells of its packages (their __init__ never runs); locating the
    # peer again in the same process (a second bench run, the GPU tests) must still find it.
    package = tmp_path / "shell_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise SystemExit('imported')\n")
    (package / "part.py").write_text("VALUE = 7\n")
    monkeypatch.setitem(sys.modules, "shell_probe_pkg", package_shell("shell_probe_pkg", str(package)))
    spec = importlib.util.find_spec("shell_probe_pkg")
    assert spec is not None and list(spec.submodule_search_locations) == [str(package)]
    try:
        assert importlib.import_module("shell_probe_pkg.part").VALUE == 7
    finally:
        sys.modules.pop("shell_probe_pkg.part", None)


def test_tier_experts_are_the_checkpoints_own_linears():
    """What the peer is given per tier is, tensor for tensor, what its loader reads from the TR3 checkpoint."""
    root = Path(sample_path("tr3"))
    pack = pack_layer(open_checkpoint(root), 3, 1)
    shard = safe_open(str(root / "model-layer-003.safetensors"), framework="pt")
    for tier in range(len(pack.tier_k)):
        experts = tier_experts(pack, tier)
        assert len(experts) == pack.tier_size[tier]
        for expert, projections in zip(pack.served_experts(tier), experts):
            for name, (trellis, suh, svh) in zip(("gate_proj", "up_proj", "down_proj"), projections):
                prefix = f"model.layers.3.mlp.experts.{expert}.{name}.rank1"
                assert trellis.shape[-1] == 16 * pack.tier_k[tier] and trellis.is_contiguous()
                assert torch.equal(trellis, shard.get_tensor(f"{prefix}.trellis"))
                assert torch.equal(suh, shard.get_tensor(f"{prefix}.suh"))
                assert torch.equal(svh, shard.get_tensor(f"{prefix}.svh"))


@pytest.mark.slow  # a whole layer forward per tier on the CPU: 45-80 s on the loaded 2-core machine
@pytest.mark.parametrize("shared_h", [False, True])
def test_per_tier_routes_sum_to_the_layer(shared_h):
    """One call per tier with that tier's experts and local ids, other routes dropped, sums to the layer."""
    pack = synthetic_pack(dataclasses.replace(SMALL, shared_h=shared_h), device="cpu", seed=4)
    served = [pack.served_experts(t) for t in range(len(pack.tier_k))]  # global id by (tier, local id)
    unserved = served[1][0]
    pack.global_to_combined[unserved] = -1  # an expert this rank does not serve: dropped by every tier
    x = random_activations(9, pack.hidden, device="cpu", seed=5)
    ids, weights = random_routes(9, 16, 4, device="cpu", seed=6)
    ids[0, 0] = unserved
    routes = split_routes(pack, ids, weights)
    total = torch.zeros((9, pack.hidden), dtype=torch.float64)
    for tier, (local, tier_weights) in enumerate(routes):
        size = pack.tier_size[tier]
        assert local.dtype == torch.int64 and tier_weights.dtype == torch.float16
        assert torch.equal(tier_weights, weights.half()) and int(local[0, 0]) == size
        kept = local < size
        assert all(served[tier][int(e)] == int(g) for e, g in zip(local[kept], ids[kept]))
        assert int(kept.sum()) == sum(1 for g in ids.flatten().tolist() if g in served[tier] and g != unserved)
        experts = dict(enumerate(tier_experts(pack, tier)))
        total += moe_forward(x, experts, local, tier_weights.float(), pack.codebook)
    assert rel_l2(total, layer_pack_forward(pack, x, ids, weights)) < 1e-3  # fp16 weights vs fp32
    exact = sum(moe_forward(x, dict(enumerate(tier_experts(pack, t))), r[0], weights, pack.codebook)
                for t, r in enumerate(routes))
    assert rel_l2(exact, layer_pack_forward(pack, x, ids, weights)) < 1e-12


def test_table_and_json_pieces():
    good = {"m": 8, "compare": {"peer": "exllamav3", "agrees": True, "us": 412.34, "ratio": 2.5, "graphs": True,
                                "rel_l2": 3e-4, "limit": 1e-2}}
    bad = {"m": 64, "compare": {"peer": "exllamav3", "agrees": False, "us": None, "ratio": None, "graphs": None,
                                "rel_l2": 1.3, "limit": 1e-2}}
    assert compare_columns([{"m": 1}]) == [] and compare_cells({"m": 1}) == []
    assert compare_columns([good]) == ["exllamav3 µs", "timed", "exllamav3/ours"]
    assert compare_cells(good) == ["412.3", "graph", "2.50"]
    assert compare_cells(bad)[0] == "wrong (rel L2 1.3)"
    assert disagreements([good, bad, {"m": 1}]) == ["M=64: rel L2 1.3 > 0.01"]
    assert peer_summary(None, None, []) == ({}, [])
    assert peer_summary("exllamav3", "it is not installed", [good]) == (
        {"compare": {"peer": "exllamav3", "skipped": "it is not installed"}}, [])
