"""fit's weight scan of a rank-sliced checkpoint, one step per linear, against the per-tensor scan: the same
inventory (buckets, styles, parts present) on good and hostile sources, or a refusal to take the short way."""

from __future__ import annotations

import pytest

from corrupt import rewrite_header
from helpers import tiny_checkpoint, write_tensors
from trellis_cli.dialects import open_checkpoint
from trellis_cli.fit import weights
from trellis_cli.fit.arch import read_arch
from trellis_cli.fit.sharding import ENGINES


def both(root):
    ckpt = open_checkpoint(root)
    arch = read_arch(ckpt.config)
    sliced_tp = ckpt.tp if any(layer.rank_sliced for layer in ckpt.layers.values()) else None
    slow = weights.Inventory(sliced_tp, ENGINES["vllm"])
    weights._scan_tensors(ckpt, arch, slow, ((r.name, r.shape, r.nbytes) for r in ckpt.tensors.values()))
    fast = weights._scan_rank_sliced(ckpt, arch, ENGINES["vllm"], sliced_tp)
    return slow, fast


def facts(inv):
    return ({key: (b.nbytes, b.experts) for key, b in inv.buckets.items()}, inv.styles, inv.present,
            inv.mtp_shared_bytes)


@pytest.mark.parametrize("changes", [{}, {"non_expert": "bf16"}])
def test_the_linear_scan_is_the_tensor_scan(tmp_path, changes):
    slow, fast = both(tiny_checkpoint(tmp_path, **changes))
    assert fast is not None and facts(fast) == facts(slow)


def test_a_name_without_its_rank_segment_takes_the_tensor_scan(tmp_path):
    root = tiny_checkpoint(tmp_path)
    old, new = "model.layers.3.mlp.experts.0.gate_proj.rank0.suh", "model.layers.3.mlp.experts.0.gate_proj.suh"
    shard = next(p for p in root.glob("*.safetensors") if old.encode() in p.read_bytes()[:1 << 20])
    rewrite_header(shard, lambda header: header.__setitem__(new, header.pop(old)))
    slow, fast = both(root)
    assert fast is None and slow.buckets


def test_an_extra_expert_tensor_takes_the_tensor_scan(tmp_path):
    import torch

    root = tiny_checkpoint(tmp_path)
    write_tensors(root / "extra.safetensors", {"model.layers.3.mlp.experts.shared_h.gate_proj.rank0.suh":
                                               torch.zeros(256, dtype=torch.float16)})
    slow, fast = both(root)
    assert fast is None and slow.buckets
