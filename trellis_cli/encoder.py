"""EXL3 encoder: exact tail-biting Viterbi per 16x16 tile, the bitstream packer and a Hessian-free quantizer.

The trellis of docs/exl3-format.md §7.2: a 16-bit state's in-edge is its top 16-K bits, its out-edge its low
16-K bits, and state s may follow state p iff in_edge(s) == out_edge(p). The Viterbi keeps one float64 cost
per edge; at each stream position every state s = (k << (16-K)) | e competes for its out-edge e with cost
(codebook(s) - target)^2 + cost[in_edge(s)]. Tail-biting (the state chain wraps from position 255 to 0)
extends the two-pass trick of the spec: an unconstrained pass started at position 128 proposes a few distinct
wrap edges at position 0, a pass constrained to start and end on each gives a valid cycle, the cheapest wins,
and one more constrained pass re-cut at position 128 polishes it (it can only lower the cost).

Everything is vectorized over tiles and states; only the 256 positions are a Python loop.

Public, tested API (tests/model/test_encoder.py, against golden vectors): encode_tiles, pack_trellis,
quantize_linear.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from trellis_cli import codec
from trellis_cli.errors import CheckFailed

# Tiles per Viterbi batch. On the CPU small batches stay in cache; on a GPU larger ones fill the device.
# Per tile and wrap candidate: ~10 bytes x 2^16 states of working set, 256 x 2^(16-K) bytes of back-pointers.
_CPU_BATCH, _CPU_BACK_BYTES = 8, 1 << 26
_GPU_BATCH, _GPU_BACK_BYTES = 256, 1 << 31

__all__ = ["encode_tiles", "pack_trellis", "quantize_linear"]


def _check_k(k: int) -> None:
    if not isinstance(k, int) or not 1 <= k <= codec.MAX_K:
        raise CheckFailed(f"K must be an integer in 1..{codec.MAX_K}, found {k!r}")


class _Trellis:
    """Viterbi over the 2^16 states of one (K, codebook) for a batch of tiles.

    A state s = (k << (16-K)) | (low << K) | sym has out-edge (low << K) | sym and in-edge (k << (16-2K)) | low.
    Per step the candidates form a 4-d block per batch: the previous costs broadcast over `sym` and the
    minimum runs over `k`. The torch CPU kernels are only fast with a long contiguous inner dim, so for
    K <= 4 the block is [tile, sym, k, low] (low has 2^(16-2K) >= 256 entries), else [tile, k, low, sym].
    """

    def __init__(self, k: int, codebook: str, device: torch.device) -> None:
        self.k = k
        self.fan = 1 << k
        self.low = 1 << (16 - 2 * k)
        self.edges = self.fan * self.low
        self.sym_outer = k <= 4
        values = codec.decode_states(torch.arange(1 << 16, device=device), codebook).double()
        values = values.view(self.fan, self.low, self.fan)  # [k, low, sym]
        if self.sym_outer:
            values = values.permute(2, 0, 1).contiguous()  # [sym, k, low]
        self.values = values.unsqueeze(0)
        self.reduce_dim = 2 if self.sym_outer else 1
        # Weight fan-1-k per candidate: the max over k of weight*is_min picks the smallest minimizing k.
        rank_shape = [1, 1, 1, 1]
        rank_shape[self.reduce_dim] = self.fan
        self.rank = torch.arange(self.fan - 1, -1, -1, device=device).to(torch.uint8).view(rank_shape)

    def _previous(self, cost: torch.Tensor) -> torch.Tensor:
        """Costs by in-edge (k, low) as a view that broadcasts over sym."""
        n = cost.shape[0]
        return cost.view(n, 1, self.fan, self.low) if self.sym_outer else cost.view(n, self.fan, self.low, 1)

    def _store(self, cost: torch.Tensor, best: torch.Tensor) -> None:
        """Write the per-out-edge minima back in edge order (edge = low * fan + sym)."""
        n = cost.shape[0]
        cost.view(n, self.low, self.fan).copy_(best.transpose(1, 2) if self.sym_outer else best)

    def forward(self, targets: torch.Tensor, start: int, pre_edge: torch.Tensor | None):
        """Costs per final out-edge [n, edges] and back-pointers uint8 [256, n, ...] (step order) holding
        fan-1-k of the best predecessor of every out-edge."""
        n, device = targets.shape[0], targets.device
        cost = torch.zeros(n, self.edges, dtype=torch.float64, device=device)
        if pre_edge is not None:
            cost.fill_(float("inf")).scatter_(1, pre_edge[:, None], 0.0)
        shape = (n, *self.values.shape[1:])
        total = torch.empty(shape, dtype=torch.float64, device=device)
        is_min = torch.empty(shape, dtype=torch.bool, device=device)
        ranked = torch.empty(shape, dtype=torch.uint8, device=device)
        reduced = [d for i, d in enumerate(shape) if i != self.reduce_dim]
        best = torch.empty(reduced, dtype=torch.float64, device=device)
        back = torch.empty(256, *reduced, dtype=torch.uint8, device=device)
        for step in range(256):
            w = targets[:, (start + step) & 255].view(n, 1, 1, 1)
            torch.sub(self.values, w, out=total)
            total.square_()
            total.add_(self._previous(cost))
            torch.amin(total, dim=self.reduce_dim, out=best)
            torch.eq(total, best.unsqueeze(self.reduce_dim), out=is_min)
            torch.mul(is_min.view(torch.uint8), self.rank, out=ranked)
            torch.amax(ranked, dim=self.reduce_dim, out=back[step])
            self._store(cost, best)
        return cost, back

    def state_at(self, back: torch.Tensor, step: int, edge: torch.Tensor) -> torch.Tensor:
        """The best state of each tile ending on out-edge `edge` ([n, c]) at `step`."""
        slot = (edge & (self.fan - 1)) * self.low + (edge >> self.k) if self.sym_outer else edge
        ranked = back[step].view(back.shape[1], self.edges).gather(1, slot).long()
        return ((self.fan - 1 - ranked) << (16 - self.k)) | edge

    def trace(self, back: torch.Tensor, final_edge: torch.Tensor) -> torch.Tensor:
        """States [n, 256] in step order of the best path ending on final_edge [n]."""
        edge = final_edge[:, None]
        states = []
        for step in range(255, -1, -1):
            state = self.state_at(back, step, edge)
            states.append(state)
            edge = state >> self.k
        return torch.cat(states[::-1], dim=1)

    def wrap_candidates(self, targets: torch.Tensor, count: int) -> torch.Tensor:
        """Up to `count` distinct edges [n, count] for the wrap at position 0, best first.

        An unconstrained pass started at position 128 is traced back from every final edge to position 0;
        each edge seen there is scored by the cheapest full path through it.
        """
        n = targets.shape[0]
        cost, back = self.forward(targets, 128, None)
        edge = torch.arange(self.edges, device=targets.device).expand(n, self.edges)
        for step in range(255, 127, -1):
            edge = self.state_at(back, step, edge) >> self.k
        best = torch.full_like(cost, float("inf")).scatter_reduce(1, edge, cost, "amin")
        return best.topk(min(count, self.edges), dim=1, largest=False).indices

    def constrained(self, targets: torch.Tensor, start: int, edge: torch.Tensor):
        """Best path through `edge` [n] at the cut before position `start`: (states by position, cost)."""
        cost, back = self.forward(targets, start, edge)
        states = torch.roll(self.trace(back, edge), start, dims=1)
        return states, cost.gather(1, edge[:, None]).squeeze(1)

    def encode(self, targets: torch.Tensor, candidates: int) -> torch.Tensor:
        """Tail-biting states [n, 256] for targets [n, 256] (float64, stream order)."""
        n = targets.shape[0]
        wraps = self.wrap_candidates(targets, candidates)
        count = wraps.shape[1]
        states, cost = self.constrained(targets.repeat_interleave(count, dim=0), 0, wraps.reshape(-1))
        pick = cost.view(n, count).argmin(dim=1)
        states = states.view(n, count, 256)[torch.arange(n, device=targets.device), pick]
        # Re-cut the chosen cycle at position 128: the path itself is a candidate, so this never gets worse.
        states, _ = self.constrained(targets, 128, states[:, 127] & (self.edges - 1))
        return states


def encode_tiles(targets: torch.Tensor, k: int, codebook: str, candidates: int = 3) -> torch.Tensor:
    """Tail-biting Viterbi: targets float [n, 256] in stream order -> 16-bit states int64 [n, 256].

    `candidates` wrap edges are tried (cost: candidates + 2 Viterbi passes); 3 beats exllamav3's encoder
    on nearly every tile. The states satisfy state_i >> K == state_{i-1} & (2^(16-K) - 1) cyclically, so
    packing their low K bits gives a bitstream that decodes to exactly codebook(states).
    """
    _check_k(k)
    codec.check_codebook(codebook)
    if not isinstance(candidates, int) or candidates < 1:
        raise CheckFailed(f"candidates must be a positive integer, found {candidates!r}")
    if targets.dim() != 2 or targets.shape[1] != 256 or not targets.dtype.is_floating_point:
        raise CheckFailed(f"targets: expected float [n, 256], found {targets.dtype} {list(targets.shape)}")
    trellis = _Trellis(k, codebook, targets.device)
    data = targets.double()
    batch = _batch_size(trellis.edges, candidates, data.is_cuda)
    with _single_thread_on_cpu(data.device):
        parts = [trellis.encode(data[i : i + batch], candidates) for i in range(0, data.shape[0], batch)]
    if not parts:
        return torch.empty(0, 256, dtype=torch.int64, device=targets.device)
    return torch.cat(parts)


def _batch_size(edges: int, candidates: int, on_gpu: bool) -> int:
    tiles, budget = (_GPU_BATCH, _GPU_BACK_BYTES) if on_gpu else (_CPU_BATCH, _CPU_BACK_BYTES)
    return max(1, min(tiles, budget // (256 * edges * candidates)))


@contextlib.contextmanager
def _single_thread_on_cpu(device: torch.device):
    """Each Viterbi op touches well under a megabyte: intra-op threads only add synchronization, and on a
    busy host they make the loop an order of magnitude slower."""
    if device.type != "cpu":
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def pack_trellis(states: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the low K bits of each state and pack them per §2.2: int [n, 256] -> int16 [n, 16K]."""
    _check_k(k)
    if states.dim() != 2 or states.shape[1] != 256 or states.dtype.is_floating_point:
        raise CheckFailed(f"states: expected integer [n, 256], found {states.dtype} {list(states.shape)}")
    n = states.shape[0]
    symbols = states.to(torch.int64) & ((1 << k) - 1)
    msb_first = torch.arange(k - 1, -1, -1, device=states.device)
    bits = ((symbols.unsqueeze(-1) >> msb_first) & 1).view(n, 16 * k, 16)
    words = (bits << torch.arange(15, -1, -1, device=states.device)).sum(-1)
    # The stored buffer swaps the two 16-bit halves of every 32-bit word (stream word m is stored at m ^ 1).
    stored = words.view(n, 8 * k, 2).flip(-1).reshape(n, 16 * k)
    return torch.where(stored >= 0x8000, stored - 0x10000, stored).to(torch.int16)


def _tiles_to_stream(w: torch.Tensor) -> torch.Tensor:
    """[in, out] -> [in/16 * out/16, 256] tiles in stream order (§2.4)."""
    rows, cols = w.shape
    tiles = w.view(rows // 16, 16, cols // 16, 16).permute(0, 2, 1, 3).reshape(-1, 256)
    return tiles[:, codec.tensor_core_perm().to(w.device)]


def _column_rms(w: torch.Tensor) -> torch.Tensor:
    rms = w.square().mean(dim=0).sqrt()
    return torch.where(rms > 0, rms, torch.full_like(rms, 0.1))


def quantize_linear(
    weight: torch.Tensor,
    k: int,
    codebook: str,
    generator: torch.Generator | None = None,
    candidates: int = 1,
) -> dict[str, Any]:
    """Quantize W [in, out] without a Hessian: random signs, output/input channel scales, Hadamard
    rotations, Viterbi per tile (a light version of the converter's regularization, §7.3). One wrap
    candidate by default (3 Viterbi passes per tile): synthesis wants speed more than the last 0.1 %.

    Returns {"trellis": int16 [in/16, out/16, 16K], "suh": fp16 [in], "svh": fp16 [out],
    "marker": {suffix: int32 0-dim tensor} ({} for 3inst)}.
    """
    _check_k(k)
    codec.check_codebook(codebook)
    if weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise CheckFailed(f"weight: expected float [in, out], found {weight.dtype} {list(weight.shape)}")
    rows, cols = (int(d) for d in weight.shape)
    if rows % codec.HADAMARD_BLOCK or cols % codec.HADAMARD_BLOCK:
        raise CheckFailed(f"weight: in and out must be multiples of 128, found [{rows}, {cols}]")
    device = weight.device
    w = weight.double()

    def random_signs(n: int) -> torch.Tensor:
        bits = torch.randint(0, 2, (n,), generator=generator, device="cpu").to(device)
        return (1 - 2 * bits).double()

    out_scale = _column_rms(w)
    out_scale = out_scale / out_scale.mean()
    sv = random_signs(cols) * out_scale
    zero_cols = w.abs().amax(dim=0) == 0
    w = codec.hadamard128(w / sv)
    sv = torch.where(zero_cols, torch.zeros_like(sv), sv)

    su = random_signs(rows) * _column_rms(w.T) / codec.codebook_rms(codebook)
    w = codec.hadamard128((w / su[:, None]).T).T

    states = encode_tiles(_tiles_to_stream(w), k, codebook, candidates)
    trellis = pack_trellis(states, k).view(rows // 16, cols // 16, 16 * k)
    return {"trellis": trellis, "suh": su.half(), "svh": sv.half(), "marker": codec.marker_tensors(codebook)}
