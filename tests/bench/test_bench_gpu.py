"""`trellis bench` end to end on a GPU: throughput JSON and the smoke table (skipped without a GPU)."""

from __future__ import annotations

import json

import pytest

from conftest import requires_gpu
from helpers import run_cli
from trellis_cli.bench.synthetic import Preset, synthetic_pack

pytestmark = [requires_gpu, pytest.mark.gpu]


def test_throughput_report_fields_on_small_layer():
    from trellis_cli.bench.throughput import run_throughput
    from trellis_cli.kernel.abi import default_library

    pack = synthetic_pack(Preset("small", 512, 256, 16, 4, "mcg", (12, 4), (3, 4), 1), device="cuda", seed=1)
    result = run_throughput(pack, default_library(), [1, 64], cold=True, replays=100)
    assert result["copy_gbps"] > 0
    for row in result["rows"]:
        assert row["fused"]["replays"] == 100 and row["copies"] >= 2
        assert 0 < row["fused"]["min_us"] <= row["fused"]["median_us"] <= row["fused"]["max_us"]
        assert row["bytes"] > 0 and row["tflops"] > 0 and row["g_weights_per_ms"] > 0


@pytest.mark.slow
def test_cli_json_production_shape(capsys):
    code, out, _ = run_cli(capsys, "bench", "--synthetic", "glm52-tp4", "--m", "1,64", "--json", "--warm")
    assert code == 0
    doc = json.loads(out)
    assert doc["environment"]["kernel"]["build_hash"] and doc["cold"] is False
    assert [r["m"] for r in doc["rows"]] == [1, 64]
    assert doc["rows"][0]["experts"] == 8



@pytest.mark.parametrize("variant, shared", [("tr3", False), ("tr3-shared-h", True)])
def test_smoke_on_the_bundled_samples(capsys, variant, shared):
    # Real quantized experts through the kernel, per-expert and shared-H (one suh/svh row: the rotation per
    # token and the output rotation after the top-k sum), against the float64 oracle.
    from trellis_cli.bench.source import load_bench_source
    from trellis_cli.sample import sample_path

    source = str(sample_path(variant))
    pack = load_bench_source(source, synthetic=None, partition=None, layer=None, rank=0, device="cpu").pack
    assert pack.shared_h == shared
    code, out, _ = run_cli(capsys, "bench", source, "--smoke", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["passed"], [c for c in doc["checks"] if not c["passed"]]
    assert any("M=3072" in c["case"] for c in doc["checks"])


GRAPHS_ACROSS_M = """
import gc
import weakref

import torch
from trellis_cli.bench.mixed_gap import gap_layers, plan_mixed_gap
from trellis_cli.bench.synthetic import random_activations, random_routes
from trellis_cli.bench.throughput import WeightPool, capture_graph, copies_needed, device_facts, touched
from trellis_cli.kernel.abi import default_library

plan = plan_mixed_gap(None, "glm52-tp4", None)
library = default_library("mcg")
pools = [WeightPool(pack, library) for _, pack in gap_layers(plan, device="cuda", seed=0)]
l2_bytes, _ = device_facts(pools[0].runners[0].device, lambda _s: None)
for m in (1, 3072):
    x = random_activations(m, 6144, device="cuda", seed=m)
    ids, weights = random_routes(m, 256, 8, device="cuda", seed=m + 1)
    graphs, outputs, expected = [], [], []
    for pool in pools:
        runners = pool.take(copies_needed(touched(pool.runners[0].pack, ids)["bytes"], l2_bytes, True))
        outs = [torch.empty((m, 6144), device="cuda") for _ in runners]  # rebound per layer, as the bench does
        graphs += [capture_graph(lambda r=r, o=o: r.forward(x, ids, weights, out=o), r.device)
                   for r, o in zip(runners, outs)]
        expected += [r.forward(x, ids, weights).cpu() for r in runners]
        outputs += [weakref.ref(o) for o in outs]
    del outs
    gc.collect()
    assert all(ref() is not None for ref in outputs), "a captured graph's output was freed"
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    for i, (ref, want) in enumerate(zip(outputs, expected)):
        assert torch.equal(ref().cpu(), want), f"M={m}: graph {i}'s output differs from its eager call"
"""


@pytest.mark.slow
def test_graphs_of_many_layers_across_m_keep_their_tensors():
    """Three layers' cold copies captured at M=1, then again at M=3072, each layer's outputs rebound as the
    bench rebinds them: every graph must keep its output alive and replay to its eager result. (When the
    graphs did not hold their outputs, the freed memory went to other tensors while the replays still wrote
    there, and a replay faulted with an illegal address.) In a child process, since an illegal address
    poisons the CUDA context of the process it happens in."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", GRAPHS_ACROSS_M], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
