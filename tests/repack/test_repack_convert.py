"""Repack conversions: per_expert -> shared-H, TP merge/split, TR3 -> TR3; exact or refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from trellis_cli import synth
from trellis_cli.dialects import open_checkpoint
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.shard_pack import pack_layer
from trellis_cli.formats.layer_pack import split_descriptor
from trellis_cli import RepackOptions, run_repack
from trellis_cli.dialects.routepack.verify import verify_route_pack

from helpers import all_tensors, assert_same_tensors

TINY = synth.preset("tiny")  # H 256, I 256 (128 per rank at TP2), 8 experts
WIDE = dataclasses.replace(TINY, intermediate=512, seed=5)  # 256 per rank at TP2: splits into TP4 exactly


@dataclasses.dataclass
class SharedHiddenSide(synth.RandomTensors):
    """Random data whose hidden-side vectors are equal across experts (`across_experts`) or across ranks."""

    across_experts: bool = True

    def linear(self, layer, expert, proj, rank, k):
        tensors = super().linear(layer, expert, proj, rank, k)
        field = synth.HIDDEN_SIDE_FIELD[proj]
        key = (layer, proj, rank) if self.across_experts else (layer, expert, proj)
        tensors[field] = synth.random_suh(self.spec.hidden, synth._generator("hidden", *key))
        return tensors


def write(tmp_path: Path, name: str, spec, *, across_experts: bool | None = None) -> Path:
    source = None if across_experts is None else SharedHiddenSide(spec, across_experts)
    return synth.write_checkpoint(tmp_path / name, spec, source=source)


def test_per_expert_to_shared_h_when_rows_are_equal(tmp_path):
    src = write(tmp_path, "src", TINY, across_experts=True)
    run_repack(src, tmp_path / "packed", RepackOptions(shared_h=True))
    assert verify_route_pack(tmp_path / "packed").ok
    pack = pack_layer(open_checkpoint(src), 3, 1, shared_h=True)
    assert pack.gate_suh.shape == (1, 256) and pack.rotation == "shared_h"
    run_repack(src, tmp_path / "tr3", RepackOptions(to="tr3", shared_h=True))
    converted = open_checkpoint(tmp_path / "tr3")
    assert converted.rotation_layout == "shared_h_v1"
    source, out = all_tensors(src), all_tensors(tmp_path / "tr3")
    assert len(out) == len(source) - 8 * 3 * 2 * 2 + 3 * 2 * 2  # 12,288 -> 9,228 at production scale
    for name, tensor in out.items():
        if ".shared_h." in name:  # the one row equals every expert's former row
            _, _, layer, _, _, _, proj, rank, field = name.split(".")
            assert torch.equal(tensor, source[f"model.layers.{layer}.mlp.experts.5.{proj}.{rank}.{field}"])
    assert_same_tensors({n: t for n, t in out.items() if ".shared_h." not in n},
                        {n: source[n] for n in out if ".shared_h." not in n})
    # the shared-H result round-trips through the route pack like any source
    run_repack(tmp_path / "tr3", tmp_path / "packed2", RepackOptions())
    run_repack(tmp_path / "packed2", tmp_path / "tr3-again", RepackOptions(to="tr3"))
    assert_same_tensors(out, all_tensors(tmp_path / "tr3-again"))


def test_shared_h_refused_naming_the_first_differing_expert(tmp_path):
    src = write(tmp_path, "src", TINY)
    with pytest.raises(CheckFailed, match=r"gate_proj suh of expert \d+ differs from expert \d+"):
        run_repack(src, tmp_path / "out", RepackOptions(shared_h=True))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_tp_merge_refused_when_ranks_were_quantized_separately(tmp_path):
    src = write(tmp_path, "src", TINY)
    with pytest.raises(CheckFailed, match="differs between rank 0 and rank 1"):
        run_repack(src, tmp_path / "out", RepackOptions(tp=1))
    with pytest.raises(UsageError, match="not a multiple of 128"):
        run_repack(src, tmp_path / "out", RepackOptions(tp=4))


def test_tp_split_and_merge_are_exact_inverses(tmp_path):
    src = write(tmp_path, "src", WIDE)
    run_repack(src, tmp_path / "tp4", RepackOptions(to="tr3", tp=4))
    four = open_checkpoint(tmp_path / "tp4")
    assert four.tp == 4 and four.intermediate == 512
    source, split = all_tensors(src), all_tensors(tmp_path / "tp4")
    gate = source["model.layers.3.mlp.experts.2.gate_proj.rank1.trellis"]  # [16, 16, 16K]: N split in halves
    assert torch.equal(split["model.layers.3.mlp.experts.2.gate_proj.rank2.trellis"], gate[:, :8])
    assert torch.equal(split["model.layers.3.mlp.experts.2.gate_proj.rank3.trellis"], gate[:, 8:])
    down = source["model.layers.3.mlp.experts.2.down_proj.rank1.trellis"]  # K split
    assert torch.equal(split["model.layers.3.mlp.experts.2.down_proj.rank3.trellis"], down[8:])
    # merging the split back is exact (the halves share their source rank's hidden-side vectors)
    run_repack(tmp_path / "tp4", tmp_path / "tp2", RepackOptions(to="tr3", tp=2))
    assert_same_tensors(source, all_tensors(tmp_path / "tp2"))
    assert json.loads((tmp_path / "tp2" / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def test_tp_merge_when_hidden_side_is_equal_across_ranks(tmp_path):
    src = write(tmp_path, "src", WIDE, across_experts=False)
    run_repack(src, tmp_path / "packed", RepackOptions(tp=1))
    assert verify_route_pack(tmp_path / "packed").ok
    pack = pack_layer(open_checkpoint(src), 4, 0, tp=1)
    tensors = all_tensors(src)
    expert = open_checkpoint(src).layers[4].partition()[3][0]  # first K3 expert: tier 0
    combined = int(pack.global_to_combined[expert])
    _, local = split_descriptor(int(pack.descriptors[combined]))
    up = torch.cat([tensors[f"model.layers.4.mlp.experts.{expert}.up_proj.rank{r}.trellis"] for r in (0, 1)], dim=1)
    assert torch.equal(pack.tier_trellis[0][local, 1], up.reshape(-1, up.shape[-1]))  # N concatenated
    down = torch.cat([tensors[f"model.layers.4.mlp.experts.{expert}.down_proj.rank{r}.trellis"] for r in (0, 1)])
    assert torch.equal(pack.tier_trellis[0][local, 2], down.reshape(-1, down.shape[-1]))  # K concatenated
    svh = torch.cat([tensors[f"model.layers.4.mlp.experts.{expert}.up_proj.rank{r}.svh"] for r in (0, 1)])
    assert torch.equal(pack.rot_intermediate[combined, 1], svh)
    assert torch.equal(pack.up_suh[combined], tensors[f"model.layers.4.mlp.experts.{expert}.up_proj.rank1.suh"])
