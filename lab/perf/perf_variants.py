"""Time kernel library variants and their phases on the production shape (glm52-tp4 192/64, cold L2).

    python3 lab/perf/perf_variants.py [LIB.so ...] [--m 1,8,64,512,3072] [--phases] [--preset NAME]

Each library is loaded with its own handle; the same weight copies serve every variant. Without LIB.so it
times the lab build of this tree (lab/kernel/lab.py, built on first use). --phases and --flags
need lab builds (python3 -m lab.kernel.lab prints the path of one): with --phases, each M is also
timed with one phase skipped (results meaningless, time is what counts), the difference to the full call
being that phase's cost. With --calls N each captured graph holds N calls in a row (each on
the next weight copy) and times are per call: the graph's own launch is then paid once per N calls.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from trellis_cli.bench.synthetic import PRESETS, clone_weights, random_activations, random_routes, synthetic_pack
from trellis_cli.bench.throughput import capture_graph, copies_needed, time_graphs, touched
from lab.kernel import lab
from trellis_cli.kernel.plan import make_plan

PHASES = {"full": 0, "-rot": lab.SKIP_ROTATE, "-fc1": lab.SKIP_FC1, "-act": lab.SKIP_ACT, "-fc2": lab.SKIP_FC2,
          "-sum": lab.SKIP_SUM, "no-pdl": lab.NO_PDL}
# --flags: same results, another launch shape
FLAGS = {"wide-span": lab.FC2_WIDE_SPAN, "narrow": lab.WGMMA_NARROW, "wide": lab.WGMMA_WIDE}


def calls(runners, outs, first, count, x, ids, w, flags):
    """`count` calls in a row, from runner `first` on, each on the next weight copy."""
    for i in range(first, first + count):
        runners[i % len(runners)].forward(x, ids, w, out=outs[i % len(runners)], lab_flags=flags)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("libs", nargs="*", help="kernel libraries (default: the lab build of this tree)")
    parser.add_argument("--m", default="1,8,64,512,3072")
    parser.add_argument("--preset", default="glm52-tp4", choices=sorted(PRESETS))
    parser.add_argument("--phases", action="store_true")
    parser.add_argument("--flags", default="", help="also time the full call with these lab flags (" + ", ".join(FLAGS) + ")")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--split", default="", help="k_split values to sweep (full call only)")
    parser.add_argument("--mtile", default="", help="m_tile values to sweep (full call only)")
    parser.add_argument("--direct", default="", help="direct mode off/on (0,1) to sweep (full call only)")
    parser.add_argument("--tail", default="", help="FC1 tail splits (1,2,4) to sweep on the default plan (full call only)")
    parser.add_argument("--calls", type=int, default=1,
                        help="calls per captured graph, each on the next weight copy; times are per call")
    args = parser.parse_args()
    ms = [int(v) for v in args.m.split(",")]
    base = synthetic_pack(PRESETS[args.preset], device="cuda", seed=0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = [base]
    phases = dict(PHASES) if args.phases else {"full": 0}
    phases.update({name: FLAGS[name] for name in args.flags.split(",") if name})
    scratch = torch.empty(1024, device="cuda")
    floor = time_graphs([capture_graph(lambda: scratch.zero_(), scratch.device)], args.replays, scratch.device)
    print(f"graph of one small kernel: {floor.median_us:.1f} us per replay; {args.calls} call(s) per graph below")
    print(f"{'variant':>10} {'M':>5} " + " ".join(f"{p:>9}" for p in phases) + "  two-pass   Gw/ms", flush=True)
    libraries = [lab.load_any(Path(p)) for p in args.libs] or [lab.lab_library(PRESETS[args.preset].codebook)]
    for lib in libraries:
        lib_path = lib.path
        for m in ms:
            x = random_activations(m, base.hidden, device="cuda", seed=m)
            ids, w = random_routes(m, 256, 8, device="cuda", seed=m + 1)
            work = touched(base, ids)
            need = copies_needed(work["bytes"], l2, True)
            while len(copies) < need:
                copies.append(clone_weights(base))
            runners = [lab.LabMoe(p, lib) for p in copies[:need]]
            outs = [torch.empty((m, base.hidden), device="cuda") for _ in runners]
            row = []
            for flags in phases.values():
                graphs = [capture_graph(lambda j=j, f=flags: calls(runners, outs, j, args.calls, x, ids, w, f), runners[0].device)
                          for j in range(len(runners))]
                row.append(time_graphs(graphs, args.replays, runners[0].device).median_us / args.calls)
            sweeps = [("k_split", int(v)) for v in args.split.split(",") if v]
            sweeps += [("m_tile", int(v)) for v in args.mtile.split(",") if v]
            sweeps += [("direct", int(v)) for v in args.direct.split(",") if v]
            sweeps += [("fc1_tail_split", int(v)) for v in args.tail.split(",") if v]
            for key, value in sweeps:
                default = runners[0].plan(m, 8)
                if key == "fc1_tail_split":  # the default plan, its FC1 tail cut another way
                    plan = dataclasses.replace(default, fc1_tail_split=value)
                else:  # a new plan, so that what follows from the swept value (FC1's tail) follows it too
                    if key == "m_tile":
                        options = {"m_tile": value}
                    elif key == "direct":
                        options = {"direct": bool(value)}
                    else:  # the default plan's tiles, cut another way
                        options = {"k_split": value, "m_tile": default.m_tile, "direct": default.direct}
                    plan = make_plan(m, 8, base.hidden, base.intermediate, base.num_combined,
                                     wgmma=runners[0].library.wgmma, **options)
                graphs = [capture_graph(lambda r=r, o=o: r.forward(x, ids, w, out=o, plan=plan), r.device)
                          for r, o in zip(runners, outs)]
                print(f"    {key}={value} (plan {plan.m_tile},{plan.k_split},{plan.fc1_tail_split}): "
                      f"{time_graphs(graphs, args.replays, runners[0].device).median_us:.1f} us")
            graphs = [capture_graph(lambda r=r, o=o: r.two_pass(x, ids, w, out=o), r.device) for r, o in zip(runners, outs)]
            two = time_graphs(graphs, args.replays, runners[0].device).median_us
            rate = work["weights"] / row[0] / 1e6
            print(f"{Path(lib_path).stem:>10} {m:>5} " + " ".join(f"{t:>9.1f}" for t in row)
                  + f" {two:>9.1f} {rate:>7.2f}", flush=True)
            del runners, outs, graphs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
