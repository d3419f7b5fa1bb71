"""The bundled sample checkpoints: real tensors from the golden expert pool, synth's layout, reproducible build."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from trellis_cli.errors import UsageError
from trellis_cli.sample import DEFAULT_VARIANT, VARIANTS, sample_path

# The builder lives outside the package, in the source checkout's tools/.
_BUILDER = Path(__file__).resolve().parents[2] / "tools" / "sample_build.py"
_spec = importlib.util.spec_from_file_location("sample_build", _BUILDER)
sample_build = importlib.util.module_from_spec(_spec)
sys.modules["sample_build"] = sample_build  # its dataclasses look their module up there
_spec.loader.exec_module(sample_build)
build = sample_build.build

DATA = Path(__file__).resolve().parents[1] / "data"
PROJS = ("gate_proj", "up_proj", "down_proj")


def load_shard(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_variants_exist_and_are_small():
    assert DEFAULT_VARIANT == "tr3" and set(VARIANTS) == {"tr3", "tr3-shared-h"}
    for variant in VARIANTS:
        root = sample_path(variant)
        assert (root / "config.json").is_file() and (root / "tier_bitmap.json").is_file()
        assert sum(p.stat().st_size for p in root.iterdir()) < 4 * 2**20
        assert not root.with_name(root.name + ".partial").exists()
    assert sample_path() == sample_path("tr3")
    with pytest.raises(UsageError, match="unknown sample variant"):
        sample_path("nope")


def test_real_sample_partitions_differ_and_interleave():
    bitmap = json.loads((sample_path() / "tier_bitmap.json").read_text())
    k3 = bitmap["3"]["k"]
    k4 = bitmap["4"]["k"]
    assert (k3.count(3), k3.count(4)) == (6, 2) and (k4.count(3), k4.count(4)) == (4, 4)
    for ks in (k3, k4):
        high = [e for e, k in enumerate(ks) if k == 4]
        assert high != list(range(high[0], high[0] + len(high)))  # interleaved, not a block
    tail = json.loads((sample_path() / "config.json").read_text())["hybrid_tr3_tail"]
    assert tail["bits"] == "mixed" and tail["tp"] == 2 and tail["moe_layers"] == [3, 4]
    assert tail["rotation_layout"] == "per_expert_v1"


def test_real_sample_tensors_are_the_golden_pool_at_the_chosen_k(golden):
    pool = golden("expert_pool_small")
    root = sample_path()
    bitmap = json.loads((root / "tier_bitmap.json").read_text())
    for layer in (3, 4):
        tensors = load_shard(root / f"model-layer-{layer:03d}.safetensors")
        assert len(tensors) == 8 * 3 * 2 * 4
        for expert, k in enumerate(bitmap[str(layer)]["k"]):
            for proj in PROJS:
                for rank in range(2):
                    prefix = f"model.layers.{layer}.mlp.experts.{expert}.{proj}.rank{rank}"
                    for field in ("trellis", "suh", "svh", "mcg"):
                        golden_tensor = pool[f"e{expert}.r{rank}.{proj}.K{k}.{field}"]
                        assert torch.equal(tensors[f"{prefix}.{field}"], golden_tensor), f"{prefix}.{field}"
                    assert tensors[f"{prefix}.trellis"].shape[-1] == 16 * k


def test_shared_h_sample_layout():
    root = sample_path("tr3-shared-h")
    tail = json.loads((root / "config.json").read_text())["hybrid_tr3_tail"]
    assert tail["rotation_layout"] == "shared_h_v1" and "shared_h_tensor_schema" in tail
    real_bitmap = json.loads((sample_path() / "tier_bitmap.json").read_text())
    assert json.loads((root / "tier_bitmap.json").read_text()) == real_bitmap
    tensors = load_shard(root / "model-layer-003.safetensors")
    assert len(tensors) == 8 * 3 * 2 * 3 + 3 * 2
    assert not any(k.endswith("gate_proj.rank0.suh") and ".shared_h." not in k for k in tensors)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifest_matches(variant):
    root = sample_path(variant)
    for line in (root / "MANIFEST.sha256").read_text().splitlines():
        digest, name = line.split("  ")
        assert hashlib.sha256((root / name).read_bytes()).hexdigest() == digest, name


def test_rebuild_reproduces_checked_in_files(tmp_path):
    built = build(DATA / "expert_pool_small.safetensors", tmp_path)
    for path in built:
        shipped = sample_path(path.name)
        assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in shipped.iterdir())
        for file in path.iterdir():
            assert file.read_bytes() == (shipped / file.name).read_bytes(), f"{path.name}/{file.name} is stale"


def test_sample_module_does_not_import_torch():
    code = "import sys, trellis_cli.sample as s; s.sample_path(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
