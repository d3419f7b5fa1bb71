"""Do two kernel library builds compute bit-identical outputs? For changes meant to keep the numerics.

    python3 lab/perf/compare_libs.py A.so B.so [--m 1,3,8,64,512,3072]

Runs both on the production shape (glm52-tp4 192/64, mcg) with the same random inputs and the plan each
library picks, fused and two-pass (production or lab builds), and prints the largest difference (0 when identical). Exit code 1 when
any output differs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from trellis_cli.bench.synthetic import PRESETS, random_activations, random_routes, synthetic_pack
from lab.kernel import lab
from trellis_cli.kernel.launch import FusedMoe


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--m", default="1,3,8,64,512,3072")
    args = parser.parse_args()
    pack = synthetic_pack(PRESETS["glm52-tp4"], device="cuda", seed=0)
    moes = [FusedMoe(pack, lab.load_any(Path(p))) for p in (args.a, args.b)]  # production or lab builds
    differ = False
    for m in (int(v) for v in args.m.split(",")):
        x = random_activations(m, pack.hidden, device="cuda", seed=m)
        ids, w = random_routes(m, 256, 8, device="cuda", seed=m + 1)
        for name, run in (("fused", lambda moe: moe.forward(x, ids, w)),
                          ("two-pass", lambda moe: moe.two_pass(x, ids, w))):
            out_a, out_b = (run(moe) for moe in moes)
            same = torch.equal(out_a, out_b)
            differ |= not same
            print(f"M={m:5d} {name:8s} plans {moes[0].plan(m, 8)} / {moes[1].plan(m, 8)}: "
                  f"max |a - b| = {float((out_a - out_b).abs().max()):.3e}{'' if same else '  DIFFERENT'}", flush=True)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
