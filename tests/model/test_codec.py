"""Codec against exllamav3's own kernel outputs (tests/data) and the worked example of the format spec."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_gpu

from trellis_cli import codec
from trellis_cli.errors import CheckFailed

CB_IDS = {0: "3inst", 1: "mcg", 2: "mul1"}
LINEAR_CONFIGS = [f"K{k}.{shape}" for k in (3, 4) for shape in ("256x128", "128x256")]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def rel_l2(found: torch.Tensor, expected: torch.Tensor) -> float:
    return ((found.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("cb_id", [0, 1, 2])
def test_codebook_matches_device_lut_for_all_states(golden, cb_id):
    lut = golden("codebook_lut")
    values = codec.decode_states(torch.arange(1 << 16, dtype=torch.int32), CB_IDS[cb_id])
    assert same_bits(values, lut[f"cb{cb_id}.single"])
    assert same_bits(values, lut[f"cb{cb_id}.pair"])


@pytest.mark.parametrize("cb_id", [0, 1, 2])
@pytest.mark.parametrize("k", range(1, 9))
def test_decode_is_bit_exact_with_reconstruct(golden, cb_id, k):
    data = golden("decode_golden")
    w_hat = codec.decode(data[f"cb{cb_id}.K{k}.trellis"], CB_IDS[cb_id])
    assert w_hat.dtype == torch.float16
    assert same_bits(w_hat, data[f"cb{cb_id}.K{k}.weight"])


def spec_example_tile() -> torch.Tensor:
    words = torch.tensor([(m * 0x9E37 + 0x1234) % 65536 for m in range(48)])
    return torch.where(words >= 32768, words - 65536, words).to(torch.int16)


def test_spec_worked_example_k3():
    states = codec.tile_states(spec_example_tile())
    assert states[:4].tolist() == [0x00B5, 0x05AC, 0x2D60, 0x6B06]
    assert int(states[255]) == 0x8016
    assert codec.decode_states(states[:4], "3inst").tolist() == [-0.1748046875, 1.130859375, 1.78515625, 0.572265625]
    assert codec.decode_states(states[:4], "mcg").tolist() == [0.23486328125, 3.625, -1.47265625, -1.37109375]
    tile = codec.decode(spec_example_tile().view(1, 1, 48), "3inst")
    assert tile[0, 0] == -0.1748046875 and tile[1, 0] == 1.130859375 and tile[8, 0] == 1.78515625
    assert tile[0, 8] == 1.22265625


def test_tile_states_form_a_tail_biting_chain():
    trellis = torch.randint(-32768, 32768, (3, 2, 16 * 5), dtype=torch.int16)
    states = codec.tile_states(trellis)
    prev = torch.roll(states, 1, dims=-1)
    assert states.shape == (3, 2, 256)
    assert torch.equal(states >> 5, prev & ((1 << 11) - 1))


def test_decode_tiles_equals_lut_of_states_in_tile_order():
    trellis = torch.randint(-32768, 32768, (2, 3, 16 * 3), dtype=torch.int16)
    stream_values = codec.decode_states(codec.tile_states(trellis), "mul1")
    tiles = codec.decode_tiles(trellis, "mul1")
    assert same_bits(tiles[..., codec.tensor_core_perm()], stream_values)


def test_unpack_signs_lsb_first():
    signs = torch.where(torch.rand(64) < 0.5, -1.0, 1.0)
    bits = (signs < 0).to(torch.int32).view(4, 16)
    words = (bits << torch.arange(16)).sum(-1)
    packed = torch.where(words >= 32768, words - 65536, words).to(torch.int16)
    unpacked = codec.unpack_signs(packed)
    assert unpacked.dtype == torch.float16
    assert torch.equal(unpacked.float(), signs)


def test_codebook_from_markers():
    assert codec.codebook_from_markers(False, False) == "3inst"
    assert codec.codebook_from_markers(True, False) == "mcg"
    assert codec.codebook_from_markers(False, True) == "mul1"
    with pytest.raises(CheckFailed, match="both"):
        codec.codebook_from_markers(True, True)


def test_marker_tensors_hold_the_converter_values():
    assert codec.marker_tensors("3inst") == {}
    assert int(codec.marker_tensors("mcg")["mcg"]) == -877912083
    assert int(codec.marker_tensors("mul1")["mul1"]) == -2082680531


def fp16_close(found: torch.Tensor, expected: torch.Tensor) -> None:
    """Within one fp16 ulp of the golden value (the kernel rounds its fp32 result once)."""
    torch.testing.assert_close(found.float(), expected.float(), rtol=2**-10, atol=2**-14)


def test_hadamard_matches_had_r_128(golden):
    data = golden("hadamard_golden")
    x, scale = data["x"], data["scale"]
    fp16_close(codec.hadamard128(x * scale), data["y_pre_scale"])
    fp16_close(codec.hadamard128(x) * scale.float(), data["y_post_scale"])


def test_hadamard_is_orthonormal_and_keeps_float64():
    x = torch.randn(5, 384, dtype=torch.float64)
    y = codec.hadamard128(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(codec.hadamard128(y), x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    assert codec.hadamard128(x.half()).dtype == torch.float32


@pytest.mark.parametrize("config", LINEAR_CONFIGS)
def test_effective_weight_and_forward_match_linear_exl3(golden, config):
    data = golden("linear_golden")
    get = lambda name: data[f"{config}.{name}"]  # noqa: E731
    codebook = codec.codebook_from_markers(f"{config}.mcg" in data, f"{config}.mul1" in data)
    args = (get("trellis"), get("suh"), get("svh"), codebook)
    assert rel_l2(codec.effective_weight(*args), get("weight_q")) <= 1e-3
    assert rel_l2(codec.effective_weight(*args, dtype=torch.float64), get("weight_q")) <= 1e-3
    for size in ("small", "large"):
        y = codec.linear_forward(get(f"x_{size}"), *args)
        assert y.dtype == torch.float32
        assert rel_l2(y, get(f"y_{size}")) <= 1e-3


def test_forward_equals_x_times_effective_weight():
    trellis = torch.randint(-32768, 32768, (8, 16, 32), dtype=torch.int16)
    suh, svh = torch.randn(128).half(), torch.randn(256).half()
    x = torch.randn(7, 128)
    w = codec.effective_weight(trellis, suh, svh, "mul1", dtype=torch.float64)
    assert rel_l2(codec.linear_forward(x, trellis, suh, svh, "mul1"), x.double() @ w) <= 1e-5


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: codec.decode(torch.zeros(1, 1, 144, dtype=torch.int16), "mcg"), "K in 1..8"),
        (lambda: codec.decode(torch.zeros(1, 1, 40, dtype=torch.int16), "mcg"), "16\\*K"),
        (lambda: codec.decode(torch.zeros(1, 1, 48, dtype=torch.int32), "mcg"), "int16"),
        (lambda: codec.decode(torch.zeros(1, 48, dtype=torch.int16), "mcg"), "3 dims"),
        (lambda: codec.decode(torch.zeros(1, 1, 48, dtype=torch.int16), "fp8"), "unknown codebook"),
        (lambda: codec.hadamard128(torch.zeros(3, 100)), "multiple of 128"),
        (lambda: codec.hadamard128(torch.zeros(3, 128, dtype=torch.int32)), "floating-point"),
        (
            lambda: codec.effective_weight(
                torch.zeros(1, 8, 48, dtype=torch.int16), torch.ones(16).half(), torch.ones(128).half(), "mcg"
            ),
            "multiples of 128",
        ),
        (
            lambda: codec.effective_weight(
                torch.zeros(8, 8, 48, dtype=torch.int16), torch.ones(64).half(), torch.ones(128).half(), "mcg"
            ),
            "suh",
        ),
    ],
)
def test_bad_input_raises_check_failed(call, message):
    with pytest.raises(CheckFailed, match=message):
        call()


@requires_gpu
@pytest.mark.gpu
def test_cuda_tensors_give_the_cpu_results(golden):
    data = golden("linear_golden")
    config = LINEAR_CONFIGS[0]
    args = [data[f"{config}.{name}"] for name in ("trellis", "suh", "svh")]
    cuda_args = [t.cuda() for t in args]
    w_hat = codec.decode(cuda_args[0], "mcg")
    assert w_hat.device.type == "cuda"
    assert same_bits(w_hat.cpu(), codec.decode(args[0], "mcg"))
    w64 = codec.effective_weight(*args, "mcg", dtype=torch.float64)
    torch.testing.assert_close(codec.effective_weight(*cuda_args, "mcg", dtype=torch.float64).cpu(), w64)
    x = data[f"{config}.x_small"]
    y = codec.linear_forward(x.cuda(), *cuda_args, "mcg").cpu()
    assert rel_l2(y, codec.linear_forward(x, *args, "mcg")) <= 1e-5
