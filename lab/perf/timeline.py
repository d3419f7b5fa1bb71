"""Where the microseconds of one fused call go: per-CTA start, wait and end times of every phase.

    python3 lab/perf/timeline.py [TL.so] [--m 1,8,64] [--replays 20] [--warm] [--split N] [--dump FILE.json]

Without TL.so it builds (on first use) and runs the timeline lab build of this tree, the mcg library as one
translation unit with -DTRELLIS_LAB -DTRELLIS_TIMELINE (lab/kernel/lab.py, lab/kernel/cuda/; `python3 -m
lab.kernel.lab --variant timeline [--commands]` builds it, or prints its nvcc command lines).
Each call runs as a captured CUDA graph on the production shape (glm52-tp4 192/64), cold L2 (replays cycle
weight copies). The timeline build stamps %globaltimer (ns) when each CTA starts,
when its wait on the previous kernel returns, and when its last warp ends. The replay whose span is the
median is printed, times in µs from the call's first CTA start:

    phase  CTAs  start first/median/last  waited first/median/last  end first/median/last  SM-busy %

SM-busy: over the phase's window (first start to last end), the mean share of time each SM that ran the
phase had at least one of its CTAs past its wait (the part where it can do the phase's work). Where SMs
held several CTAs of a phase, two more lines say how many SMs held how many and when those ended, and when
the CTAs placed first, second, ... on their SM ended. Marks are stamps a kernel sets at points of its own
(timeline_mark): the compiler may move arithmetic across them, so they bound where a CTA was, not what it
had finished. A phase of more than 16384 CTAs (the rotation at
M=3072) folds the rest into its last row, so its CTA count reads 16384.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from trellis_cli.bench.synthetic import PRESETS, clone_weights, random_activations, random_routes, synthetic_pack
from trellis_cli.bench.throughput import capture_graph, copies_needed, touched
from lab.kernel import lab
from trellis_cli.kernel.plan import make_plan
from trellis_cli.formats.layer_pack import split_descriptor

PHASES = lab.TIMELINE_PHASES


def union_length(intervals: list[tuple[int, int]]) -> int:
    total, cur_start, cur_end = 0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return total + (cur_end - cur_start if cur_end is not None else 0)


def sm_load_lines(sm_ctas: dict[int, list[tuple[int, int]]], us) -> list[str]:
    """How a phase's CTAs sat on the SMs (per SM, its CTAs' (waited, end) in grid order): per count of CTAs
    an SM held, how many SMs and when their last CTA ended; per place on an SM, when those CTAs ended. CTAs
    sharing an SM do not end together: the one placed first runs ahead (run 252)."""
    per_sm = {sm: [end for _, end in ctas] for sm, ctas in sm_ctas.items()}
    if max(len(v) for v in per_sm.values()) < 2:
        return []
    counts = sorted({len(v) for v in per_sm.values()})[:6]
    held = " / ".join(str(sum(len(v) == n for v in per_sm.values())) for n in counts)
    last = " / ".join(f"{us(statistics.median(max(v) for v in per_sm.values() if len(v) == n)):.1f}" for n in counts)
    places = min(4, max(len(v) for v in per_sm.values()))
    by_place = " / ".join(f"{us(statistics.median(v[i] for v in per_sm.values() if len(v) > i)):.1f}"
                          for i in range(places))
    return [f"SMs holding {' / '.join(map(str, counts))} CTAs: {held}, their last end (median) {last}",
            f"end by place on the SM (1st / 2nd ...), median: {by_place}"]


def report(timeline, t0: int) -> None:
    us = lambda t: (t - t0) / 1000.0  # noqa: E731
    trio = lambda v: f"{us(min(v)):6.1f} {us(statistics.median(v)):6.1f} {us(max(v)):6.1f}"  # noqa: E731
    print(f"{'phase':>7} {'CTAs':>5}   {'start':^20}   {'waited':^20}   {'end':^20}  SM-busy")
    for name, rows in zip(PHASES, timeline):
        if not rows:
            continue
        starts = [r[0] for r in rows]
        waited = [r[1] if r[1] else r[0] for r in rows]
        ends = [r[2] for r in rows]
        lo, hi = min(starts), max(ends)
        per_sm: dict[int, list[tuple[int, int]]] = {}
        for (s, w, e, sm, *_), wt in zip(rows, waited):
            per_sm.setdefault(sm, []).append((wt, e))
        busy = statistics.mean(union_length(v) for v in per_sm.values()) / max(1, hi - lo) * 100
        print(f"{name:>7} {len(rows):>5}   {trio(starts)}   {trio(waited)}   {trio(ends)}  "
              f"{busy:5.1f} % of {len(per_sm)} SMs")
        for i in range(4):
            marks = [r[4 + i] for r in rows if r[4 + i]]
            if marks:
                print(f"{'':>7} {'':>5}   mark {i}: {trio(marks)}  ({len(marks)} CTAs)")
        for line in sm_load_lines(per_sm, us):
            print(f"{'':>7} {'':>5}   {line}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lib", nargs="?", help="a timeline lab build (default: this tree's, built on first use)")
    parser.add_argument("--m", default="1,8,64")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--warm", action="store_true", help="one weight copy: code and weights stay in L2")
    parser.add_argument("--split", type=int, default=0, help="k_split (FC1 planes) for packed calls, in place of the plan's")
    parser.add_argument("--dump", default="", help="write the median replays' raw rows and routes to this JSON file")
    args = parser.parse_args()
    lib = lab.load_any(Path(args.lib)) if args.lib else lab.lab_library("mcg", variant="timeline")
    base = synthetic_pack(PRESETS["glm52-tp4"], device="cuda", seed=0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    copies = [base]
    dump = {}
    for m in (int(v) for v in args.m.split(",")):
        x = random_activations(m, base.hidden, device="cuda", seed=m)
        ids, w = random_routes(m, 256, 8, device="cuda", seed=m + 1)
        need = copies_needed(touched(base, ids)["bytes"], l2, not args.warm)
        while len(copies) < need:
            copies.append(clone_weights(base))
        runners = [lab.LabMoe(p, lib) for p in copies[:need]]
        outs = [torch.empty((m, base.hidden), device="cuda") for _ in runners]
        plan = runners[0].plan(m, 8)
        if args.split and not plan.direct:
            plan = make_plan(m, 8, base.hidden, base.intermediate, base.num_combined, m_tile=plan.m_tile,
                             k_split=args.split, wgmma=runners[0].library.wgmma)
        graphs = [capture_graph(lambda r=r, o=o: r.forward(x, ids, w, out=o, plan=plan), r.device)
                  for r, o in zip(runners, outs)]
        for g in graphs * 2:  # warm-up: code and descriptors resident, weights cycle
            g.replay()
        torch.cuda.synchronize()
        lab.read_timeline(lib)
        runs = []
        for i in range(args.replays):
            graphs[i % len(graphs)].replay()
            torch.cuda.synchronize()
            tl = lab.read_timeline(lib)
            t0 = min(r[0] for rows in tl for r in rows)
            t1 = max(r[2] for rows in tl for r in rows)
            runs.append((t1 - t0, tl, t0))
        runs.sort(key=lambda r: r[0])
        span, tl, t0 = runs[len(runs) // 2]
        print(f"\nM={m}: span of the median replay {span / 1000:.1f} us "
              f"(all replays {runs[0][0] / 1000:.1f}-{runs[-1][0] / 1000:.1f})")
        report(tl, t0)
        combined = base.global_to_combined.to(ids.device)[ids.long().reshape(-1)]
        tiers = split_descriptor(base.descriptors.to(ids.device)[combined.clamp(min=0)])[0].tolist()
        dump[m] = {"t0": t0, "phases": {n: rows for n, rows in zip(PHASES, tl)},
                   "route_expert": combined.tolist(), "route_tier": tiers}
        del runners, outs, graphs
        torch.cuda.empty_cache()
    if args.dump:
        Path(args.dump).write_text(json.dumps(dump))


if __name__ == "__main__":
    main()
