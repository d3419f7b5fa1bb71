"""Every `trellis repack` conversion, run by two checkouts of trellis on the same sources: the output trees must be
equal byte for byte (file names and contents).

    python tools/compare_repack_outputs.py OLD_CHECKOUT NEW_CHECKOUT WORKDIR

Sources (written once, by NEW's synth): the `tiny` preset (per-expert and shared-H), the `glm52-tp4` preset's
geometry (hidden 6144, intermediate 2048, TP4, mixed K) cut to one layer of 8 experts, the bundled sample (both
rotation layouts), and two exl3-v1 checkpoints (mixed K per expert; uniform shared-H), each also renamed to BTX.
Each conversion runs as `python -m trellis_cli repack ...` with PYTHONPATH set to one checkout, into its own OUT;
the chains (route pack -> TR3, exl3-v1 -> TR3 -> exl3-v1, BTX -> exl3-v1) start from the old checkout's outputs so
both checkouts read the same bytes. A conversion both refuse must be refused in the same words. Exit 0 when
every tree is equal, 1 naming each difference otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def repack(checkout: Path, source: Path, out: Path, *args: str) -> tuple[int, str]:
    """The exit status and, for a refusal, its error line with OUT's side folder named `SIDE`."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    # --jobs 1: with several workers, which of two bad layers is refused first is a race.
    done = subprocess.run([sys.executable, "-m", "trellis_cli", "repack", str(source), str(out), *args, "--jobs", "1"],
                          cwd=checkout, env=env, capture_output=True, text=True)
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    # Which of several bad layers a run meets first is not fixed (the pool's first failure wins): the layer
    # number is left out of the comparison of refusals.
    return done.returncode, re.sub(r"layer \d+", "layer N", (error[-1] if error else "").replace(str(out.parent),
                                                                                           "SIDE"))


def sources(new: Path, work: Path) -> dict[str, Path]:
    sys.path.insert(0, str(new))
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
    from trellis_cli.synth import SynthSpec, preset, write_checkpoint

    made = {
        "tiny": write_checkpoint(work / "src-tiny", preset("tiny")),
        "tiny-shared": write_checkpoint(work / "src-tiny-shared",
                                        dataclasses.replace(preset("tiny"), rotation_layout="shared_h_v1")),
        "glm52-cut": write_checkpoint(work / "src-glm52-cut", dataclasses.replace(
            preset("glm52-tp4"), layers=(3,), experts=8, partition=(6, 2), top_k=2)),
        "exl3v1-mixed": write_exl3v1_checkpoint(work / "src-exl3v1-mixed", SynthSpec(
            hidden=256, intermediate=1024, experts=6, tp=1, layers=(3, 4), partition=(5, 1), top_k=2)),
        "exl3v1-shared": write_exl3v1_checkpoint(work / "src-exl3v1-shared", SynthSpec(
            hidden=256, intermediate=512, experts=4, tp=1, layers=(3,), uniform_k=4, top_k=2,
            rotation_layout="shared_h_v1")),
    }
    for name in ("tr3", "tr3-shared-h"):
        made[f"sample-{name}"] = Path(shutil.copytree(new / "trellis_cli" / "sample" / name, work / f"src-sample-{name}"))
    return made


# (output name, source name or an earlier output, repack arguments)
RUNS: list[tuple[str, str, tuple[str, ...]]] = []
for _src in ("tiny", "tiny-shared", "glm52-cut", "sample-tr3", "sample-tr3-shared-h"):
    RUNS += [(f"{_src}.pack", _src, ()), (f"{_src}.pack-tp1", _src, ("--tp", "1")),
             (f"{_src}.pack-layer4-rank0", _src, ("--layers", "4", "--ranks", "0")),
             (f"{_src}.pack-experts-only", _src, ("--experts-only",)),
             (f"{_src}.tr3-tp1", _src, ("--to", "tr3", "--tp", "1")),
             (f"{_src}.tr3-tp8", _src, ("--to", "tr3", "--tp", "8")),
             (f"{_src}.exl3v1", _src, ("--to", "exl3-v1")),
             (f"{_src}.tr3-shared-h", _src, ("--to", "tr3", "--shared-h")),
             (f"{_src}.pack.tr3", f"{_src}.pack", ("--to", "tr3"))]
RUNS = [r for r in RUNS if not (r[0].startswith("glm52-cut.") and "4" in r[2])  # it holds layer 3 only
        and not (r[0].endswith("tr3-tp8") and not r[0].startswith("glm52-cut."))]  # TP8 of 256 channels: refused
for _src in ("exl3v1-mixed", "exl3v1-shared"):
    RUNS += [(f"{_src}.pack", _src, ()), (f"{_src}.pack-tp2", _src, ("--tp", "2")),
             (f"{_src}.tr3", _src, ("--to", "tr3")), (f"{_src}.tr3-tp2", _src, ("--to", "tr3", "--tp", "2")),
             (f"{_src}.pack.tr3", f"{_src}.pack", ("--to", "tr3")),
             (f"{_src}.tr3.exl3v1", f"{_src}.tr3", ("--to", "exl3-v1")),
             (f"{_src}.btx", _src, ("--to", "btx")),
             (f"{_src}.btx.exl3v1", f"{_src}.btx", ("--to", "exl3-v1"))]


def main() -> int:
    old, new, work = (Path(a).resolve() for a in sys.argv[1:4])
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    made = sources(new, work)
    for side in ("old", "new"):
        (work / side).mkdir()
    compared = differences = 0
    for name, src, args in RUNS:
        source = made[src] if src in made else work / "old" / src
        answers = [repack(checkout, source, work / side / name, *args)
                   for side, checkout in (("old", old), ("new", new))]
        if answers[0] != answers[1]:
            print(f"DIFFERENT {name} ({src} {' '.join(args)}): old {answers[0]}, new {answers[1]}")
            differences += 1
            continue
        if answers[0][0] != 0:  # refused by both, in the same words
            compared += 1
            print(f"refused {name:39s} by both: {answers[0][1][:90]}")
            continue
        a, b = tree(work / "old" / name), tree(work / "new" / name)
        if a != b:
            diff = sorted(set(a.items()) ^ set(b.items()))
            print(f"DIFFERENT {name} ({src} {' '.join(args)}): first {diff[0][0]}")
            differences += 1
            continue
        compared += 1
        print(f"equal  {name:40s} {len(a):3d} files  (repack {src} {' '.join(args)})")
    if differences:
        print(f"{differences} conversion(s) DIFFERENT, {compared} equal")
        return 1
    print(f"{compared} conversions, every output tree equal byte for byte (refusals: in the same words)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
