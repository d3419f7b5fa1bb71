"""b12x 1.5.1's own exl3-v1 code as the oracle: it reads what trellis writes, trellis accepts what it writes.

Skipped when b12x is not installed (`pip install --no-deps b12x==1.5.1`; torch is all it needs on a CPU).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from trellis_cli.synth import SynthSpec
from helpers import run_cli as run_cli_split

b12x_exl3 = pytest.importorskip("b12x.moe.checkpoints.exl3")


def b12x_synth():
    """b12x's synthetic writer; its kernels package imports CUDA bindings, so it is registered empty first."""
    import b12x.moe._shared as shared

    name = "b12x.moe._shared.kernels"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.__path__ = [str(Path(shared.__path__[0]) / "kernels")]
        sys.modules[name] = stub
    from b12x.moe._shared.kernels.w4a16 import exl3_synth

    return exl3_synth


def run_cli(capsys, *args: str) -> tuple[int, str]:
    code, out, _ = run_cli_split(capsys, *args)
    return code, out


def read_every_extent(root: Path) -> list:
    """Every layer at every TP degree the layout allows, read by b12x with verify_sha=True."""
    manifest = b12x_exl3.read_exl3_manifest(root)
    slots = manifest.geometry.num_slots
    layers = []
    for layer in manifest.geometry.moe_layer_indices:
        for tp in (1, 2):
            count = slots // tp
            for rank in range(tp):
                layers.append(b12x_exl3.read_exl3_layer(root, manifest, layer, first_slot=rank * count,
                                                        slot_count=count, verify_sha=True))
    return layers


@pytest.mark.parametrize("spec", [
    SynthSpec(hidden=256, intermediate=512, experts=4, tp=1, layers=(3, 5), uniform_k=3, top_k=2),
    SynthSpec(hidden=256, intermediate=512, experts=6, tp=1, layers=(3,), partition=(5, 1), top_k=2,
              rotation_layout="shared_h_v1"),
], ids=["uniform", "pair"])
def test_b12x_reads_trellis_synth(tmp_path, spec):
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    root = write_exl3v1_checkpoint(tmp_path / "ck", spec)
    layers = read_every_extent(root)
    assert layers and all(layer.codes.dtype.is_floating_point is False for layer in layers)
    if spec.uniform_k:
        source, weights = b12x_exl3.trellis_from_exl3(layers[0])
        assert weights.codes.shape[0] == 16


@pytest.mark.parametrize("rates", [None, "pair"])
def test_trellis_accepts_b12x_synth(capsys, tmp_path, rates):
    import torch

    synth = b12x_synth()
    if rates is None:
        config = synth.Exl3SynthConfig(codebook="mcg", num_experts=4, hidden_size=256, intermediate_size=512,
                                       moe_layer_indices=(3, 5), bits=3)
    else:
        table = torch.full((2, 4), 0x33, dtype=torch.uint8)
        table[:, 1] = 0x44
        table[1, 2] = 0x24
        config = synth.Exl3SynthConfig(codebook="mcg", num_experts=4, hidden_size=256, intermediate_size=512,
                                       moe_layer_indices=(3,), rate_tables={3: (table, table.clone())},
                                       extent_alignment_slots=8, per_expert_input_rotations=True)
    synth.write_exl3_checkpoint(tmp_path / "b12x", config)
    code, out = run_cli(capsys, "validate", str(tmp_path / "b12x"), "--deep", "--checksums", "--json")
    assert code == 0, out
    assert json.loads(out)["context"]["dialect"] == "exl3-v1"
    code, out = run_cli(capsys, "inspect", str(tmp_path / "b12x"), "--json")
    row = json.loads(out)["layers"][0]
    assert row["partition"] == ("4" if rates is None else "2/1/1")


def test_b12x_pair_alignment_four_is_refused(capsys, tmp_path):
    """b12x's parser takes per_expert_pair with 4-slot extents; trellis names why that splits a pair."""
    import torch

    synth = b12x_synth()
    table = torch.full((2, 4), 0x33, dtype=torch.uint8)
    config = synth.Exl3SynthConfig(codebook="mcg", num_experts=4, hidden_size=256, intermediate_size=512,
                                   moe_layer_indices=(3,), rate_tables={3: (table, table.clone())})
    synth.write_exl3_checkpoint(tmp_path / "b12x", config)
    code, out = run_cli(capsys, "validate", str(tmp_path / "b12x"), "--json")
    assert code == 1 and {f["code"] for f in json.loads(out)["findings"]} == {"exl3v1.pair-alignment"}


def test_b12x_reassembles_the_tr3_source_tiles(capsys, tmp_path):
    """TR3 (TP2, uniform K3, hidden-side equal across ranks) -> exl3-v1 by trellis; b12x's reader (verify_sha),
    adapter and slot assembler give back every rank's gate, up and down trellis bit for bit."""
    import torch
    from safetensors import safe_open

    from trellis_cli.checkpoint.names import expert_key
    from b12x.moe.fused_moe.trellis_layout import assemble_uniform_slots

    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    spec = SynthSpec(hidden=256, intermediate=1024, experts=4, tp=1, layers=(3,), uniform_k=3, top_k=2)
    seed = write_exl3v1_checkpoint(tmp_path / "seed", spec)
    assert run_cli(capsys, "repack", str(seed), str(tmp_path / "tr3"), "--to", "tr3", "--tp", "2")[0] == 0
    code, out = run_cli(capsys, "repack", str(tmp_path / "tr3"), str(tmp_path / "exl3"), "--to", "exl3-v1")
    assert code == 0, out
    manifest = b12x_exl3.read_exl3_manifest(tmp_path / "exl3")
    with safe_open(str(tmp_path / "tr3" / "model-layer-003.safetensors"), framework="pt") as tr3:
        for rank in range(2):
            layer = b12x_exl3.read_exl3_layer(tmp_path / "exl3", manifest, 3, first_slot=16 * rank, slot_count=16,
                                              verify_sha=True)
            _, weights = b12x_exl3.trellis_from_exl3(layer)
            w13, w2 = assemble_uniform_slots(weights.codes, num_experts=4, hidden_size=256, bits=3, device="cpu")
            for e in range(4):
                for proj, tiles in (("gate_proj", w13[0, e]), ("up_proj", w13[1, e]), ("down_proj", w2[e])):
                    want = tr3.get_tensor(expert_key(3, e, proj, rank, "trellis"))
                    assert torch.equal(tiles.reshape(want.shape), want), (rank, e, proj)
                svh = tr3.get_tensor(expert_key(3, e, "gate_proj", rank, "svh"))
                assert torch.equal(layer.rotations[:, e, 0].reshape(-1).view(torch.int16), svh.view(torch.int16))
