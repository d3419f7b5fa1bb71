"""Stage-by-stage check of the fused kernel on a small layer: route pack, FC1, activation, FC2, output.

A debugging aid for the GPU machine: each stage's workspace is compared with the same stage computed in
float64 from trellis_cli.codec, so a wrong result points at the stage that broke. Prints one line per
stage and codebook/K; exit 1 when any stage is off.
"""

from __future__ import annotations

import sys

import torch

from trellis_cli.bench.synthetic import Preset, random_activations, random_routes, synthetic_pack
from trellis_cli.codec import decode, hadamard128
from trellis_cli.kernel.launch import FusedMoe
from lab.kernel.oracle import plain_columns, route_combined
from trellis_cli.kernel.plan import activation_expand
from trellis_cli.reference import layer_pack_forward, pack_expert


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def expected_stages(pack, x, route_expert, route_token):
    """Per route: FC1 gate/up sums (before the output rotation), activated input of FC2, FC2 output (left
    unrotated where every expert shares one svh row: the top-k sum rotates once per token)."""
    shared_down = pack.down_svh.shape[0] == 1
    fc1, act, fc2 = [], [], []
    for combined, token in zip(route_expert, route_token):
        (tg, sg, vg), (tu, su, vu), (td, sd, vd) = pack_expert(pack, combined)
        xt = x[token].double()
        g = hadamard128((xt * sg.double())[None])[0] @ decode(tg, pack.codebook).double()
        u = hadamard128((xt * su.double())[None])[0] @ decode(tu, pack.codebook).double()
        fc1.append(torch.cat([g, u]))
        gate = hadamard128(g[None])[0] * vg.double()
        up = hadamard128(u[None])[0] * vu.double()
        a = hadamard128((torch.nn.functional.silu(gate) * up * sd.double())[None])[0]
        act.append(a)
        y = a.half().double() @ decode(td, pack.codebook).double()
        fc2.append(y if shared_down else hadamard128(y[None])[0] * vd.double())
    return torch.stack(fc1), torch.stack(act), torch.stack(fc2)


def check(codebook: str, tier_k: tuple[int, int], m: int, m_tile: int | None = None, k_split: int | None = None,
          direct: bool | None = None, shared_h: bool = False) -> bool:
    preset = Preset("small", 512, 256, 16, 4, codebook, (12, 4), tier_k, 1, shared_h=shared_h)
    pack = synthetic_pack(preset, device="cuda", seed=3)
    moe = FusedMoe(pack)
    x = random_activations(m, pack.hidden, device="cuda", seed=5)
    ids, w = random_routes(m, 16, 4, device="cuda", seed=6)
    plan = moe.plan(m, 4)
    if m_tile or k_split or direct is not None:
        from trellis_cli.kernel.plan import make_plan

        plan = make_plan(m, 4, pack.hidden, pack.intermediate, pack.num_combined, m_tile=m_tile, k_split=k_split,
                         direct=direct)
    # FC1 writes only the partial-sum planes of each tile's pieces (fc1_split.cuh): start from zeros so the
    # sum over planes below is the tile's FC1
    moe._workspace(plan)["partial"].zero_()
    out = moe.forward(x, ids, w, plan=plan)
    torch.cuda.synchronize()
    ws = moe._workspace(plan)
    ref = layer_pack_forward(moe.pack, x, ids, w)
    if plan.direct:  # tile t = slot t = route t, for every route this rank serves
        g2c = moe.pack.global_to_combined.tolist()
        desc, sizes = moe.pack.descriptors.tolist(), moe.pack.tier_size
        combined = [route_combined(int(e), g2c, desc, sizes) for e in ids.reshape(-1).tolist()]
        routes = [r for r, c in enumerate(combined) if c >= 0]
        slots, experts, tiles = routes, [combined[r] for r in routes], len(routes)
    else:
        tiles = int(ws["tile_count"][0])
        slots, experts = [], []
        for t in range(tiles):
            e, s, r = int(ws["tile_expert"][t]), int(ws["tile_start"][t]), int(ws["tile_rows"][t])
            slots += list(range(s, s + r))
            experts += [e] * r
        routes = ws["slot_route"][slots].long().tolist()
    tokens = [r // 4 for r in routes]
    fc1, act, fc2 = expected_stages(moe.pack, x, experts, tokens)
    got_fc1 = ws["partial"].sum(0)[slots]
    got_act = ws["act"][slots]
    if activation_expand(plan) == 2:
        got_act = plain_columns(got_act)
    got_fc2 = ws["route_out"][routes] / w.reshape(-1)[routes][:, None]
    layout = " shared-H" if shared_h else ""
    line = (f"{codebook:5s} K{tier_k}{layout} M={m:4d} plan=({plan.m_tile},{plan.k_split}) tiles={tiles:3d} "
            f"routes={len(routes):4d}/{m * 4}  fc1 {rel(got_fc1, fc1):.2e}  act {rel(got_act, act):.2e}  fc2 {rel(got_fc2, fc2):.2e}  "
            f"out {rel(out, ref):.2e}")
    ok = len(routes) == m * 4 and rel(out, ref) < 1e-3
    print(("ok   " if ok else "FAIL ") + line, flush=True)
    return ok


def main() -> int:
    results = []
    for codebook in ("mcg", "3inst", "mul1"):
        results.append(check(codebook, (3, 4), 5))
        results.append(check(codebook, (3, 4), 2))  # direct mode: one tile per route, rotation inside FC1
    results.append(check("mcg", (5, 6), 3))
    for k in ((1, 2), (5, 6), (7, 8)):
        results.append(check("mcg", k, 13))  # 52 routes: packed 16-row tiles
    results.append(check("mcg", (3, 4), 5, direct=False))  # packed tiles of at most 8 routes
    results.append(check("mcg", (3, 4), 300, m_tile=16))  # full 16-row tiles: two 8-route blocks
    results.append(check("mcg", (3, 4), 300))
    results.append(check("mcg", (3, 4), 300, m_tile=128))
    results.append(check("mcg", (3, 4), 300, m_tile=32))  # mid tiles: up to four 8-route blocks
    results.append(check("3inst", (5, 6), 300, m_tile=32))
    results.append(check("mcg", (3, 4), 5, k_split=4))  # FC1 partial sums over several H ranges
    results.append(check("mcg", (3, 4), 300, m_tile=128, k_split=2))
    results.append(check("mcg", (3, 4), 1100, m_tile=128))  # 4400 routes: the route pack over many CTAs
    results.append(check("mcg", (5, 6), 300, m_tile=128))  # the all-K kernel with large tiles
    for m, m_tile in ((2, None), (13, None), (300, 32), (300, 128)):  # one svh row: FC2's rows stay unrotated
        results.append(check("mcg", (3, 4), m, m_tile=m_tile, shared_h=True))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
