"""What each rank of an exl3-v1 container reads at a TP, for `trellis fit`: its extent of slots from `codes`,
`rotations` and the rate tables (rows along dim 0), and the whole hidden-side tables and sign pattern."""

from __future__ import annotations

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import LayerShare, RankShare
from trellis_cli.errors import CheckFailed, UsageError


def layer_shares(ckpt: Checkpoint, tp: int, rates_below: int) -> list[LayerShare]:
    from trellis_cli.dialects.exl3v1.container import CODES, RATES_FC1, RATES_FC2, ROTATIONS, container, layer_rates
    from trellis_cli.dialects.exl3v1.layout import bundle_bytes, rank_extent, tp_problem
    from trellis_cli.dialects.exl3v1.schema import SLOT_CHANNELS, SLOTS_PER_PAIR

    box = container(ckpt)
    m = box.manifest
    if m is None:
        raise CheckFailed("exl3-manifest.json: the exl3-v1 manifest could not be read; a damaged source "
                          "(run `trellis validate` for the findings)")
    problem = tp_problem(m, tp)
    if problem:
        raise UsageError(f"--tp {tp}: this exl3-v1 container cannot be split so ({problem})")
    sliced = {CODES, ROTATIONS, RATES_FC1, RATES_FC2}
    shares = []
    for index, layer in box.layers.items():
        rates = layer_rates(ckpt, index) if index < rates_below else None
        ranks = []
        for rank in range(tp):
            first, count = rank_extent(m, tp, rank)
            layer_bytes = 0
            for name, ref in layer.tensors.items():
                rows = ref.shape[0] if ref.shape else 0
                if name in sliced and rows:
                    layer_bytes += ref.nbytes // rows * (rows // tp)
                else:
                    layer_bytes += ref.nbytes
            experts = None
            if rates is not None:
                rate_bytes = 2 * (count // SLOTS_PER_PAIR) if m.pair_structure else 0
                experts = []
                for e in range(m.num_experts):
                    b = sum(bundle_bytes(m.hidden, *rates.codes(s, e)) for s in range(first, first + count))
                    b += count * 3 * SLOT_CHANNELS * 2 + rate_bytes
                    experts.append((rates.expert_k(e, m.num_slots), b))
            ranks.append(RankShare(layer_bytes, experts))
        shares.append(LayerShare(index, sum(ref.nbytes for ref in layer.tensors.values()), ranks))
    return shares
