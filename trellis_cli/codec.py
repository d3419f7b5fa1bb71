"""EXL3 codec: bit-exact trellis decode, codebooks, the 128-block Hadamard and the linear forward.

Pure torch math with no I/O. Every function works on CPU and CUDA tensors alike and returns results on the
device of its input. The normative description is docs/exl3-format.md (sections cited as §n):

  trellis int16 [in/16, out/16, 16*K]  --tile_states-->  int32 [in/16, out/16, 256] (16-bit states, stream order)
                                        --decode------>  fp16 W_hat [in, out] (rows = input features)
  W_eff = diag(suh) · H_in · W_hat · H_out · diag(svh),  y = x · W_eff

Codebooks are named "3inst" (no marker), "mcg" (`.mcg` marker) and "mul1" (`.mul1` marker).
"""

from __future__ import annotations

import functools
import math

import torch

from trellis_cli.codebooks import BY_NAME, NAMES
from trellis_cli.errors import CheckFailed

CODEBOOKS = NAMES


def _multiplier(name: str) -> int:
    value = BY_NAME[name].multiplier
    assert value is not None  # a procedural codebook: it has a multiplier
    return value


MCG_MULTIPLIER = _multiplier("mcg")
MUL1_MULTIPLIER = _multiplier("mul1")
MAX_K = 8
TILE = 16
HADAMARD_BLOCK = 128

_MASK32 = 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------------
# Codebooks (§3): 16-bit state -> fp16 value


def _as_fp16(bits16: torch.Tensor) -> torch.Tensor:
    """Reinterpret the low 16 bits of an integer tensor as IEEE binary16."""
    signed = torch.where(bits16 >= 0x8000, bits16 - 0x10000, bits16)
    return signed.to(torch.int16).view(torch.float16)


def _two_half_sum(x: torch.Tensor) -> torch.Tensor:
    """fp16 RNE sum of the two halves of a 32-bit word. Both halves lie in ±[0.125, 2), so their float32 sum
    is exact and one rounding to fp16 equals the hardware's fp16 addition (proved by the LUT test)."""
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = _as_fp16(x & 0xFFFF).float()
    hi = _as_fp16(x >> 16).float()
    return (lo + hi).half()


def decode_states(states: torch.Tensor, codebook: str) -> torch.Tensor:
    """Codebook value (fp16) of each 16-bit state; `states` is any integer tensor with values 0..65535."""
    check_codebook(codebook)
    if states.dtype.is_floating_point or states.dtype == torch.bool:
        raise CheckFailed(f"decode_states: states must be an integer tensor, found {states.dtype}")
    s = states.to(torch.int64) & 0xFFFF
    if codebook == "3inst":
        return _two_half_sum((s * 89226354 + 64248484) & _MASK32)
    if codebook == "mcg":
        return _two_half_sum((s * MCG_MULTIPLIER) & _MASK32)
    x = (s * MUL1_MULTIPLIER) & _MASK32
    byte_sum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
    # (1024 + sum) * 0x1EEE + 0xC931 as one fp16 FMA; the float32 value below is exact, so .half() is that FMA.
    return ((1774 * byte_sum - 905216).float() / 262144.0).half()


@functools.lru_cache(maxsize=None)
def _codebook_lut(codebook: str, device: str) -> torch.Tensor:
    check_codebook(codebook)
    return decode_states(torch.arange(1 << 16, device=device), codebook)


def codebook_rms(codebook: str) -> float:
    """RMS of the codebook over all 65536 states (≈1.2437 for 3inst/mcg, ≈1.0003 for mul1)."""
    values = _codebook_lut(codebook, "cpu").double()
    return float(values.square().mean().sqrt())


def codebook_from_markers(has_mcg: bool, has_mul1: bool) -> str:
    """Codebook selected by a linear's marker tensors (§1.2); both at once is refused (the GEMM rejects it)."""
    if has_mcg and has_mul1:
        raise CheckFailed("both .mcg and .mul1 markers present: at most one codebook marker is allowed")
    return "mcg" if has_mcg else "mul1" if has_mul1 else "3inst"


def marker_tensors(codebook: str) -> dict[str, torch.Tensor]:
    """The marker tensor a converter writes for `codebook` ({} for 3inst), keyed by suffix ("mcg"/"mul1")."""
    check_codebook(codebook)
    entry = BY_NAME[codebook]
    if entry.marker is None:
        return {}
    return {entry.marker: torch.tensor(entry.marker_value, dtype=torch.int32)}


def check_codebook(codebook: str) -> None:
    """Raise CheckFailed unless `codebook` is one of CODEBOOKS."""
    if codebook not in CODEBOOKS:
        raise CheckFailed(f"unknown codebook {codebook!r}: expected one of {', '.join(CODEBOOKS)}")


# ---------------------------------------------------------------------------------------------------
# Bitstream (§2): tile words -> 256 states -> W_hat


def tensor_core_perm() -> torch.Tensor:
    """perm[i] = row-major tile index (16*r + c) of stream position i (§2.4)."""
    i = torch.arange(256)
    t, j = i // 8, i % 8
    r = 2 * (t % 4) + (j & 1) + 8 * ((j >> 1) & 1)
    c = t // 4 + 8 * (j >> 2)
    return r * TILE + c


def inverse_tensor_core_perm() -> torch.Tensor:
    """inv[16*r + c] = stream position stored at tile row r, column c."""
    inv = torch.empty(256, dtype=torch.int64)
    inv[tensor_core_perm()] = torch.arange(256)
    return inv


def trellis_k(trellis: torch.Tensor, name: str = "trellis") -> int:
    """K of a trellis tensor after checking dtype, rank and last dim (§1.1)."""
    if trellis.dtype != torch.int16:
        raise CheckFailed(f"{name}: expected dtype int16, found {trellis.dtype}")
    if trellis.dim() < 1:
        raise CheckFailed(f"{name}: expected a tensor with last dim 16*K, found a 0-dim tensor")
    k, rem = divmod(int(trellis.shape[-1]), 16)
    if rem or not 1 <= k <= MAX_K:
        raise CheckFailed(f"{name}: last dim must be 16*K with K in 1..{MAX_K}, found {trellis.shape[-1]}")
    return k


@functools.lru_cache(maxsize=None)
def _window_tables(k: int, device: str, row_major: bool) -> tuple[torch.Tensor, ...]:
    """For each position: the two stored words holding its 16-bit window and the shifts that align it.

    The window of position i is stream bits [(i+1)K-16, (i+1)K) mod 256K (§2.3): the low 16-o bits of
    stream word m followed by the top o bits of word m+1. Stream word m is stored word m^1 (§2.2), so the
    tables index stored words directly. With row_major the positions are reordered so that the gather lands
    values in row-major tile order (§2.4).
    """
    words = 16 * k
    pos = inverse_tensor_core_perm() if row_major else torch.arange(256)
    start = ((pos + 1) * k - 16) % (256 * k)
    first = start // 16
    second = (first + 1) % words
    offset = start % 16
    tables = (first ^ 1, second ^ 1, offset.to(torch.int32), (16 - offset).to(torch.int32))
    return tuple(t.to(device) for t in tables)


def _states(trellis: torch.Tensor, row_major: bool) -> torch.Tensor:
    k = trellis_k(trellis)
    first, second, offset, rest = _window_tables(k, str(trellis.device), row_major)
    words = trellis.to(torch.int32) & 0xFFFF
    # A 16-bit word shifted left by at most 15 stays below 2^31: no int32 overflow anywhere.
    return ((words[..., first] << offset) | (words[..., second] >> rest)) & 0xFFFF


def tile_states(trellis: torch.Tensor) -> torch.Tensor:
    """The 256 decode states of every tile, in stream order: int16 [..., 16K] -> int32 [..., 256]."""
    return _states(trellis, row_major=False)


def decode_tiles(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """Decoded tiles in row-major tile order: int16 [..., 16K] -> fp16 [..., 256] (element 16r+c)."""
    check_codebook(codebook)
    states = _states(trellis, row_major=True)
    return _codebook_lut(codebook, str(trellis.device))[states]


def decode(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """W_hat (fp16 [in, out], rows = input features) of a trellis int16 [in/16, out/16, 16K] (§2.5)."""
    if trellis.dim() != 3:
        raise CheckFailed(f"trellis: expected 3 dims [in/16, out/16, 16K], found shape {list(trellis.shape)}")
    kt, nt = int(trellis.shape[0]), int(trellis.shape[1])
    tiles = decode_tiles(trellis, codebook).view(kt, nt, TILE, TILE)
    return tiles.permute(0, 2, 1, 3).reshape(kt * TILE, nt * TILE)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Legacy `.su`/`.sv` (int16 [n/16]) -> fp16 ±1 [n]: bit b of word w (LSB first) is element 16w+b (§1.3)."""
    if packed.dtype != torch.int16 or packed.dim() != 1:
        raise CheckFailed(f"packed signs: expected 1-dim int16, found {packed.dtype} shape {list(packed.shape)}")
    bits = (packed.to(torch.int32).unsqueeze(-1) >> torch.arange(16, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


# ---------------------------------------------------------------------------------------------------
# Hadamard rotation and the linear forward (§4)


@functools.lru_cache(maxsize=None)
def _hadamard_matrix(dtype: torch.dtype, device: str) -> torch.Tensor:
    idx = torch.arange(HADAMARD_BLOCK)
    parity = torch.zeros(HADAMARD_BLOCK, HADAMARD_BLOCK, dtype=torch.int64)
    anded = idx[:, None] & idx[None, :]
    for bit in range(7):  # popcount parity of i & j, 7 bits
        parity ^= (anded >> bit) & 1
    signs = 1.0 - 2.0 * parity.to(torch.float64)
    return (signs / math.sqrt(HADAMARD_BLOCK)).to(dtype=dtype, device=device)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def hadamard128(x: torch.Tensor) -> torch.Tensor:
    """x · (I ⊗ Ĥ) over the last dim in blocks of 128, Ĥ = Sylvester H128 / √128; float32 result (float64
    for float64 input)."""
    if not x.dtype.is_floating_point:
        raise CheckFailed(f"hadamard128: expected a floating-point tensor, found {x.dtype}")
    n = int(x.shape[-1]) if x.dim() else 0
    if x.dim() == 0 or n % HADAMARD_BLOCK:
        raise CheckFailed(f"hadamard128: last dim must be a multiple of {HADAMARD_BLOCK}, found {n}")
    dtype = _compute_dtype(x)
    h = _hadamard_matrix(dtype, str(x.device))
    blocks = x.to(dtype).reshape(*x.shape[:-1], n // HADAMARD_BLOCK, HADAMARD_BLOCK)
    return (blocks @ h).reshape(x.shape)


def _check_scales(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> None:
    trellis_k(trellis)
    if trellis.dim() != 3:
        raise CheckFailed(f"trellis: expected 3 dims [in/16, out/16, 16K], found shape {list(trellis.shape)}")
    rows, cols = 16 * int(trellis.shape[0]), 16 * int(trellis.shape[1])
    if rows % HADAMARD_BLOCK or cols % HADAMARD_BLOCK:
        raise CheckFailed(f"trellis: in and out must be multiples of {HADAMARD_BLOCK}, found [{rows}, {cols}]")
    for name, vec, n in (("suh", suh, rows), ("svh", svh, cols)):
        if not vec.dtype.is_floating_point or vec.dim() != 1 or int(vec.shape[0]) != n:
            raise CheckFailed(f"{name}: expected a float vector of length {n}, found {vec.dtype} {list(vec.shape)}")


def effective_weight(
    trellis: torch.Tensor,
    suh: torch.Tensor,
    svh: torch.Tensor,
    codebook: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """W_eff [in, out] = diag(suh) · H_in · W_hat · H_out · diag(svh) in `dtype` (float32 or float64)."""
    _check_scales(trellis, suh, svh)
    if dtype not in (torch.float32, torch.float64):
        raise CheckFailed(f"effective_weight: dtype must be float32 or float64, found {dtype}")
    w = decode(trellis, codebook).to(dtype)
    w = hadamard128(w.T).T  # H_in from the left == Hadamard of each column (Ĥ is symmetric)
    w = hadamard128(w)
    return w * suh.to(dtype)[:, None] * svh.to(dtype)[None, :]


def linear_forward(
    x: torch.Tensor, trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str
) -> torch.Tensor:
    """y = (((x ⊙ suh) · H_in) · W_hat · H_out) ⊙ svh in float32; x is [..., in]."""
    _check_scales(trellis, suh, svh)
    if not x.dtype.is_floating_point or int(x.shape[-1]) != int(suh.shape[0]):
        raise CheckFailed(f"x: expected float [..., {suh.shape[0]}], found {x.dtype} {list(x.shape)}")
    xh = hadamard128(x.float() * suh.float())
    y = xh @ decode(trellis, codebook).float()
    return hadamard128(y) * svh.float()
