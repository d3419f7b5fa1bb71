"""per_expert_pair placement checked with b12x 1.5.1's reader, against the TR3 source's own tiles.

b12x has no public function that decodes pair records on a CPU: its pair path (`prepare_exl3_moe_weights` in
`b12x.moe._shared.kernels.w4a16.exl3`) prepares CUDA weights, and the helpers that restore record order are
private. So the oracle here is what its public API does expose: `read_exl3_layer` (with `verify_sha=True`)
gives each TP extent's rate rows, `codes` rows, rotations and hidden-side tables, and `exl3_schema`'s public
byte helpers (`bundle_bytes`, `matrix_slot_bytes`, `rate_code_bits`) say where each plane sits in a row. The
expected bytes come from the placement rule written out below, applied to the TR3 source's tiles: in pair P,
slot 8P+j holds tile j of the pair's first 128-channel record in its low plane and tile j of the second
record in its high plane (gate/up: N16 tiles; down: K16 tiles), and the rotations follow the same channels.
Skipped when b12x is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_cli
from trellis_cli.checkpoint.names import expert_key
from trellis_cli.synth import SynthSpec, write_checkpoint

pytest.importorskip("b12x")
b12x_exl3 = pytest.importorskip("b12x.moe.checkpoints.exl3")
b12x_schema = pytest.importorskip("b12x.moe._shared.exl3_schema")

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
INTERMEDIATE_SIDE = ("svh", "svh", "suh")
HIDDEN_SIDE = {"gate_suh": ("gate_proj", "suh"), "up_suh": ("up_proj", "suh"), "down_svh": ("down_proj", "svh")}


def run_ok(*args: str) -> None:
    code, out, err = run_cli(None, *args)
    assert code == 0, (args, err)


class Tr3:
    """The TR3 source's tensors by key, read straight from its shards."""

    def __init__(self, root: Path) -> None:
        from safetensors import safe_open

        self.tensors = {}
        for path in root.glob("*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                self.tensors.update({name: f.get_tensor(name) for name in f.keys()})

    def get(self, layer: int, expert: int, proj: str, rank: int, field: str):
        return self.tensors[expert_key(layer, expert, proj, rank, field)]


def predicted_plane(tr3: Tr3, layer: int, expert: int, matrix: int, rank: int, local_slot: int, plane: int):
    """The bytes the placement rule puts in one plane: a 16-channel tile of the rank's TR3 trellis."""
    pair, j = divmod(local_slot, 8)
    tile = 16 * pair + 8 * plane + j  # record `plane` of the pair, tile j of it
    trellis = tr3.get(layer, expert, PROJECTIONS[matrix], rank, "trellis")
    words = trellis[:, tile] if matrix < 2 else trellis[tile]  # [H/16, 16K]: one plane
    return words.contiguous().view(-1), list(range(16 * tile, 16 * tile + 16))


def plane_bytes(layer_codes, rates_fc1, rates_fc2, hidden: int, slot: int, expert: int, matrix: int, plane: int):
    """One plane of b12x's codes row, located with b12x's own public byte helpers."""
    import torch

    pair = slot // 8
    offset = sum(b12x_schema.bundle_bytes(hidden, int(rates_fc1[pair, e]), int(rates_fc2[pair, e]))
                 for e in range(expert))
    fc1, fc2 = int(rates_fc1[pair, expert]), int(rates_fc2[pair, expert])
    low, high = b12x_schema.rate_code_bits(fc1 if matrix < 2 else fc2)
    offset += min(matrix, 2) * b12x_schema.matrix_slot_bytes(hidden, *b12x_schema.rate_code_bits(fc1))
    low_bytes = b12x_schema.matrix_slot_bytes(hidden, low, 0)
    start, length = (offset, low_bytes) if plane == 0 else (offset + low_bytes,
                                                            b12x_schema.matrix_slot_bytes(hidden, 0, high))
    return layer_codes[slot, start:start + length].contiguous().view(torch.int16)


@pytest.mark.parametrize("tp", [1, 2])
def test_b12x_reads_the_pair_placement_of_a_mixed_k_tr3_source(tmp_path, tp):
    import torch

    spec = SynthSpec(hidden=256, intermediate=1024, experts=6, tp=1, layers=(3,), partition=(4, 2), top_k=2)
    if tp == 1:
        source = write_checkpoint(tmp_path / "tr3", spec)  # one rank: nothing to agree across ranks
    else:  # two ranks with byte-identical hidden-side vectors: the way a TR3 source can convert exactly
        from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

        seed = write_exl3v1_checkpoint(tmp_path / "seed", spec)
        run_ok("repack", str(seed), str(tmp_path / "tr3"), "--to", "tr3", "--tp", "2")
        source = tmp_path / "tr3"
    run_ok("repack", str(source), str(tmp_path / "exl3"), "--to", "exl3-v1")
    tr3 = Tr3(source)
    k_of = {e: tr3.get(3, e, "gate_proj", 0, "trellis").shape[-1] // 16 for e in range(spec.experts)}
    assert sorted(set(k_of.values())) == [3, 4]

    manifest = b12x_exl3.read_exl3_manifest(tmp_path / "exl3")
    assert manifest.rates.structure == "per_expert_pair" and set(manifest.rates.pair_kinds) == {"P33", "P44"}
    count = manifest.geometry.num_slots // tp
    for rank in range(tp):
        layer = b12x_exl3.read_exl3_layer(tmp_path / "exl3", manifest, 3, first_slot=rank * count,
                                          slot_count=count, verify_sha=True)
        want_rates = torch.tensor([[17 * k_of[e] for e in range(spec.experts)]] * (count // 8), dtype=torch.uint8)
        assert torch.equal(layer.rates_fc1, want_rates) and torch.equal(layer.rates_fc2, want_rates)
        for j in range(count):
            for e in range(spec.experts):
                for matrix in range(3):
                    for plane in range(2):
                        want, channels = predicted_plane(tr3, 3, e, matrix, rank, j, plane)
                        got = plane_bytes(layer.codes, layer.rates_fc1, layer.rates_fc2, spec.hidden, j, e, matrix,
                                          plane)
                        assert torch.equal(got, want), (rank, j, e, PROJECTIONS[matrix], plane)
                        vector = tr3.get(3, e, PROJECTIONS[matrix], rank, INTERMEDIATE_SIDE[matrix]).reshape(-1)
                        stored = layer.rotations[j, e, matrix, 16 * plane:16 * plane + 16]
                        assert torch.equal(stored.view(torch.int16), vector[channels].view(torch.int16))
        for name, (proj, side) in HIDDEN_SIDE.items():
            for e in range(spec.experts):
                want = tr3.get(3, e, proj, rank, side).reshape(-1)
                assert torch.equal(getattr(layer, name)[e].view(torch.int16), want.view(torch.int16)), (name, e)
