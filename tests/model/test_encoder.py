"""Encoder against exllamav3's tail-biting Viterbi and packer (tests/data/encoder_golden)."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_gpu

from trellis_cli import codec, encoder
from trellis_cli.errors import CheckFailed

CB_IDS = {0: "3inst", 1: "mcg", 2: "mul1"}
ALL_CONFIGS = [(cb, k) for cb in CB_IDS for k in range(1, 9)]


def golden_config(golden, cb_id: int, k: int) -> dict:
    data = golden("encoder_golden")
    return {name: data[f"cb{cb_id}.K{k}.{name}"] for name in ("input_tiles_stream_order", "states", "packed")}


def is_tail_biting_chain(states: torch.Tensor, k: int) -> bool:
    previous = torch.roll(states, 1, dims=-1)
    return torch.equal(states >> k, previous & ((1 << (16 - k)) - 1))


def decode_packed_in_stream_order(packed: torch.Tensor, codebook: str) -> torch.Tensor:
    """Decode packed tiles with the full `decode` (tiles side by side as one [16, 16n] W_hat)."""
    n, words = packed.shape
    w_hat = codec.decode(packed.view(1, n, words), codebook)
    tiles = w_hat.view(16, n, 16).permute(1, 0, 2).reshape(n, 256)
    return tiles[:, codec.tensor_core_perm()]


@pytest.mark.parametrize(("cb_id", "k"), ALL_CONFIGS)
def test_packer_is_bit_exact_and_states_round_trip(golden, cb_id, k):
    config = golden_config(golden, cb_id, k)
    states = config["states"].to(torch.int64) & 0xFFFF
    assert is_tail_biting_chain(states, k)
    assert torch.equal(encoder.pack_trellis(states, k), config["packed"])
    assert torch.equal(codec.tile_states(config["packed"]).long(), states)


def check_encoder(golden, cb_id: int, k: int, tiles: int) -> None:
    config = golden_config(golden, cb_id, k)
    codebook = CB_IDS[cb_id]
    targets = config["input_tiles_stream_order"][:tiles].double()
    states = encoder.encode_tiles(targets, k, codebook)
    assert states.shape == (tiles, 256)
    assert is_tail_biting_chain(states, k)
    mine = codec.decode_states(states, codebook)
    theirs = codec.decode_states(config["states"][:tiles].to(torch.int64) & 0xFFFF, codebook)
    my_mse = (mine.double() - targets).square().mean().item()
    their_mse = (theirs.double() - targets).square().mean().item()
    assert my_mse <= their_mse * (1 + 1e-6)
    decoded = decode_packed_in_stream_order(encoder.pack_trellis(states, k), codebook)
    assert torch.equal(decoded.view(torch.int16), mine.view(torch.int16))


# About 2.5 s each: the unit loop keeps the production widths (K3, K4) of every codebook, the full suite walks all.
VITERBI_CONFIGS = [pytest.param(cb, k, marks=() if k in (3, 4) else pytest.mark.slow) for cb, k in ALL_CONFIGS]


@pytest.mark.parametrize(("cb_id", "k"), VITERBI_CONFIGS)
def test_viterbi_matches_or_beats_exllamav3_on_four_tiles(golden, cb_id, k):
    check_encoder(golden, cb_id, k, tiles=4)


@pytest.mark.slow
@pytest.mark.parametrize(("cb_id", "k"), [(0, 1), (1, 2), (2, 3), (0, 4), (2, 1)])
def test_viterbi_matches_or_beats_exllamav3_on_all_tiles(golden, cb_id, k):
    """Every K <= 4 and every codebook once on all 32 tiles (~10 s each on a busy 2-core host)."""
    check_encoder(golden, cb_id, k, tiles=32)


@pytest.mark.slow
def test_quantize_linear_reconstructs_the_weight():
    """64 tiles x 3 Viterbi passes: ~4 s on an idle core."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(128, 128, generator=generator)
    weight[:, 5] = 0.0  # a padding-like column: svh must be 0 there
    q = encoder.quantize_linear(weight, 4, "mcg", generator)
    assert q["trellis"].shape == (8, 8, 64) and q["trellis"].dtype == torch.int16
    assert q["suh"].dtype == torch.float16 and q["suh"].shape == (128,)
    assert q["svh"].dtype == torch.float16 and q["svh"].shape == (128,)
    assert set(q["marker"]) == {"mcg"} and int(q["marker"]["mcg"]) == -877912083
    assert q["svh"][5] == 0 and torch.count_nonzero(q["svh"]) == 127
    assert (q["suh"] < 0).any() and (q["suh"] > 0).any()
    w_eff = codec.effective_weight(q["trellis"], q["suh"], q["svh"], "mcg", dtype=torch.float64)
    assert torch.all(w_eff[:, 5] == 0)
    rel = ((w_eff - weight.double()).norm() / weight.double().norm()).item()
    assert rel < 0.12


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: encoder.encode_tiles(torch.randn(2, 256), 9, "mcg"), "K must be"),
        (lambda: encoder.encode_tiles(torch.randn(2, 128), 3, "mcg"), "targets"),
        (lambda: encoder.encode_tiles(torch.randn(2, 256), 3, "q4"), "unknown codebook"),
        (lambda: encoder.encode_tiles(torch.randn(2, 256), 3, "mcg", candidates=0), "candidates"),
        (lambda: encoder.pack_trellis(torch.zeros(2, 256), 3), "integer"),
        (lambda: encoder.quantize_linear(torch.randn(100, 128), 3, "mul1"), "multiples of 128"),
    ],
)
def test_bad_input_raises_check_failed(call, message):
    with pytest.raises(CheckFailed, match=message):
        call()


@requires_gpu
@pytest.mark.gpu
def test_cuda_encoder_gives_the_cpu_states(golden):
    targets = golden_config(golden, 2, 3)["input_tiles_stream_order"][:4]
    on_cpu = encoder.encode_tiles(targets, 3, "mul1")
    on_gpu = encoder.encode_tiles(targets.cuda(), 3, "mul1")
    assert on_gpu.device.type == "cuda"
    assert is_tail_biting_chain(on_gpu.cpu(), 3)
    # Same float64 arithmetic; only the order among equal-cost candidates may differ between devices.
    mse = [(codec.decode_states(s.cpu(), "mul1").double() - targets.double()).square().mean() for s in (on_gpu, on_cpu)]
    assert abs(mse[0] - mse[1]) <= 1e-12 * mse[1]
    assert torch.equal(encoder.pack_trellis(on_gpu, 3).cpu(), encoder.pack_trellis(on_gpu.cpu(), 3))
