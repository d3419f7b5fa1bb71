"""Data rules (--deep): read the tensors of chosen layers and check what headers cannot show.

suh/svh finite and not all zero (nor all subnormal); svh exactly zero only on padding columns (none, unless the
config's logical size is below the padded one); a decode of a few sampled
tiles per layer through the codec with a plausible RMS; under per_expert_v1, whether the hidden-side rows are
byte-identical across experts (then the checkpoint could be repacked to shared_h_v1). Marker values are
rules_markers' (read by default for local sources, and with --deep for remote ones).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint, MoeLayer, VectorRef
from trellis_cli.checkpoint.names import H_SIDE
from trellis_cli.checkpoint.tensors import read_rows, read_tensor
from trellis_cli.errors import CheckFailed
from trellis_cli.findings import Finding, Location, Severity, error, warning

SAMPLED_EXPERTS = 2  # per layer: the first expert of the lowest and of the highest tier
SAMPLED_TILE_ROWS = 2  # leading tile rows decoded per sampled trellis
# Decoded codebook values have RMS ~1.24 (3inst, mcg) or ~1 (mul1); far outside means a broken writer.
DECODE_RMS_RANGE = (0.3, 3.0)


def check_vectors(ckpt: Checkpoint, vectors: Iterable[VectorRef], count: Callable[[str, int], None]
                  ) -> Iterator[Finding]:
    """Every dialect's suh / svh (as its Dialect.vectors lists them): finite, not all zero, not all subnormal."""
    for vector in vectors:
        yield from _check_vector(ckpt, vector, count)


def check_layer_tiles(ckpt: Checkpoint, layer: MoeLayer, count: Callable[[str, int], None]) -> Iterator[Finding]:
    """Per-linear shards: a decode of sampled tiles, and whether per-expert hidden-side rows could be shared."""
    yield from _check_sampled_decode(ckpt, layer, count)
    if not layer.shared_h:
        yield from _check_h_rows_shareable(ckpt, layer)


def _read(ckpt: Checkpoint, vector: VectorRef) -> tuple[Any, Finding | None]:  # (a tensor or None, problem)
    ref = vector.ref
    try:
        if vector.row is None:
            return read_tensor(ckpt, ref), None
        return read_rows(ckpt, ref, vector.row, vector.row + 1), None
    except CheckFailed as e:
        return None, error("data.unreadable", Location(file=ref.file, tensor=ref.name), str(e).split(": ", 2)[-1])


def _check_vector(ckpt: Checkpoint, vector: VectorRef, count) -> Iterator[Finding]:
    import torch

    at, name = vector.at, vector.kind
    values, problem = _read(ckpt, vector)
    if problem is not None:
        yield problem
        return
    count("vectors read", 1)
    smallest_normal = torch.finfo(values.dtype).tiny if values.dtype.is_floating_point else 0.0
    values = values.float().reshape(-1)
    bad = int((~torch.isfinite(values)).sum())
    if bad:
        yield error("data.nonfinite", at, f"{name} holds NaN or Inf", expected="finite values",
                    found=f"{bad} of {values.numel()} non-finite")
        return
    zeros = int((values == 0).sum())
    if zeros == values.numel():
        yield error("data.zero-vector", at, f"{name} is all zeros (the linear's output would vanish)")
    elif bool((values.abs() < smallest_normal).all()):  # subnormals: flushed to zero by fast kernels, or near it
        largest = float(values.abs().max())
        yield error("data.subnormal-vector", at, f"{name} holds only zeros and subnormals (as dead as zeros)",
                    expected=f"some |value| >= {smallest_normal:.3g}", found=f"max |value| {largest:.3g}")
    elif zeros and name == "svh":
        yield warning("data.svh-zero", at, "svh has exact zeros outside padding columns (those outputs are dropped)",
                      expected="0 zero columns", found=f"{zeros} zero columns")
    elif zeros and name == "suh":
        yield warning("data.suh-zero", at, "suh has exact zeros (only fp16 underflow should give them)",
                      found=f"{zeros} zeros")


def _sampled(layer: MoeLayer) -> list[int]:
    tiers = list(layer.partition().values())
    picks = {tiers[0][0], tiers[-1][0]} if tiers else set()
    return sorted(picks)[:SAMPLED_EXPERTS] or sorted(layer.experts)[:1]


def _check_sampled_decode(ckpt: Checkpoint, layer: MoeLayer, count) -> Iterator[Finding]:
    from trellis_cli import codec

    for expert in _sampled(layer):
        for proj in PROJECTIONS:
            lin = layer.experts.get(expert, {}).get(proj, {}).get(0)
            if lin is None or lin.trellis is None or lin.trellis.dtype != "I16" or not 1 <= (lin.k or 0) <= 8:
                continue  # malformed trellis tensors are header findings already
            if lin.mcg is not None and lin.mul1 is not None:
                continue  # marker.both: the codebook is ambiguous
            if 0 in lin.trellis.shape:
                continue  # no tiles to decode; the header rules report its geometry
            at = Location(layer=layer.index, expert=expert, projection=proj, rank=0, tensor=lin.trellis.name)
            try:
                rows = read_rows(ckpt, lin.trellis, 0, min(SAMPLED_TILE_ROWS, lin.trellis.shape[0]))
                w_hat = codec.decode(rows, lin.codebook).float()
            except CheckFailed as e:
                yield error("data.unreadable", at, str(e).split(": ", 2)[-1])
                continue
            count("tiles decoded", rows.shape[0] * rows.shape[1])
            rms = float(w_hat.pow(2).mean().sqrt())
            low, high = DECODE_RMS_RANGE
            if not math.isfinite(rms) or not low <= rms <= high:
                yield warning("data.decode-rms", at, "decoded tiles have an implausible RMS", expected=f"{low}..{high}",
                              found=round(rms, 4))
            if bool((rows == rows.reshape(-1)[0]).all()):
                yield warning("data.constant-trellis", at, "sampled trellis words are all identical (a writer that "
                              "never wrote the data?)", found=int(rows.reshape(-1)[0]))


def _check_h_rows_shareable(ckpt: Checkpoint, layer: MoeLayer) -> Iterator[Finding]:
    """Info for repack: per (projection, rank), are all experts' hidden-side rows byte-identical?"""
    import torch

    if len(layer.experts) < 2:
        return
    tp = max((r for projs in layer.experts.values() for by in projs.values() for r in by), default=0) + 1
    shareable = True
    for proj in PROJECTIONS:
        for rank in range(tp):
            first = None
            for expert in sorted(layer.experts):
                lin = layer.experts[expert].get(proj, {}).get(rank)
                ref = getattr(lin, H_SIDE[proj], None) if lin is not None else None
                if ref is None:
                    return
                try:
                    row = read_tensor(ckpt, ref)
                except CheckFailed:
                    return
                if first is None:
                    if not bool(row.view(torch.int16).any()):  # zero rows are data.zero-vector, not shareable
                        return
                    first = row
                elif not torch.equal(first.view(torch.int16), row.view(torch.int16)):
                    shareable = False
                    break
            if not shareable:
                return
    yield Finding("data.h-shareable", Severity.INFO, Location(layer=layer.index), "hidden-side rows are byte-identical across experts: "
                  "the layer can be repacked to shared_h_v1 losslessly")
