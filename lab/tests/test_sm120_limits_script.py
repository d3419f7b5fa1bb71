"""lab/perf/sm120_limits.sh: its GPU-free step (the plans under sm_120's limits, 128-row tiles from M=3072 on the
compact kernels) runs here; the builds it asks for are the mma.sync-only ones."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "lab" / "perf" / "sm120_limits.sh"


def test_plan_step_runs_without_a_gpu(tmp_path: Path):
    env = {**os.environ, "OUT": str(tmp_path), "TRELLIS_KERNEL_CACHE": str(tmp_path / "cache"), "NO_COLOR": "1"}
    done = subprocess.run(["bash", str(SCRIPT), "plan"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for preset in ("glm52-tp4", "glm52-tp4-k3k5"):  # K3/K4, and K3/K5 on the all-K kernels
        doc = json.loads((tmp_path / f"plan-{preset}.out").read_text())
        assert doc["limits"]["arch"] == "sm_120" and doc["limits"]["source"] == "override"
        assert [(p["m"], p["family"]) for p in doc["plans"]] == [
            (1, "mma16"), (8, "mma16"), (64, "mma16"), (512, "mma32"), (3072, "mma128"), (8192, "mma128")], preset


def test_mma_sync_only_build_has_no_wgmma(monkeypatch):
    from trellis_cli.kernel import build
    from trellis_cli.kernel.nvcc import MMA_SYNC_ONLY_ENV

    production = build.library_units("sm_90", "mcg", kernels="k3k4")
    monkeypatch.setenv(MMA_SYNC_ONLY_ENV, "1")
    portable = build.library_units("sm_90", "mcg", kernels="k3k4")
    assert [u.name for u in production] == ["host", "mcg-mma16-k3k4", "mcg-mma32-k3k4", "mcg-mma128-k3k4",
                                            "mcg-wgmma-k3k4"]
    assert [u.name for u in portable] == ["host", "mcg-mma16-k3k4", "mcg-mma32-k3k4", "mcg-mma128-k3k4"]
    flags = build.build_commands("sm_90", "mcg", kernels="k3k4")[0]
    assert "-gencode=arch=compute_90,code=sm_90" in flags and "-DTRELLIS_WGMMA" not in flags
    # Its objects never take the wgmma build's cache entries: the flags are in every object's hash.
    source = build.kernel_source_dir()
    host = portable[0]
    monkeypatch.delenv(MMA_SYNC_ONLY_ENV)
    wgmma_hash = build.unit_hash(host, "sm_90", "13.0.88", source)
    monkeypatch.setenv(MMA_SYNC_ONLY_ENV, "1")
    assert build.unit_hash(host, "sm_90", "13.0.88", source) != wgmma_hash
