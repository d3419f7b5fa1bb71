"""Bit-exact comparison of what was written with what it came from: every read-back of a repack or
conversion (route-pack layer files, TR3 shards, carried tensors, exl3-v1 layer files) decides with these."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def bytes_of(tensor: "torch.Tensor"):
    import torch

    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def same_bits(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """Bit equality of dtype, shape and bytes (fp16 NaN payloads and -0.0 count; numpy memcmp is fast)."""
    import numpy as np

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(bytes_of(a), bytes_of(b)))


def equal_bytes(a, b) -> bool:
    """memcmp speed: numpy compares 8-byte words when it can (byte-wise equality is 3x slower)."""
    import numpy as np

    x, y = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    if len(x) != len(y):
        return False
    if len(x) % 8 == 0:
        x, y = x.view(np.int64), y.view(np.int64)
    return bool(np.array_equal(x, y))
