"""Wall time and peak RSS of the commands that read a checkpoint's headers, beside a bare `json.loads` of every
header, in one run (the machine may be loaded: only the ratios carry over). Best of N rounds, commands
interleaved so that a burst of load hits all of them alike.

    python tools/bench_reader.py SRC COPY OUT [--rounds 2]

SRC: `trellis synth SRC --preset glm52-tp4 --sparse`; COPY: a copy of SRC with one expert changed (diff's
other side); OUT: a path that does not exist (repack --dry-run plans into it, writes nothing).
Prints a Markdown table (seconds, MB, ratio to the bare parse) and writes nothing else but the package's
bytecode: the commands run as an installed package does (its modules compiled once, at install), so
PYTHONDONTWRITEBYTECODE is dropped for them and one untimed run of each comes first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

BARE = """
import glob, json, struct, sys
for path in sorted(glob.glob(sys.argv[1] + "/*.safetensors")):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        json.loads(f.read(n))
"""


def commands(src: str, copy: str, out: str) -> dict[str, list[str]]:
    trellis = [sys.executable, "-m", "trellis_cli"]
    return {
        "bare json.loads of every header": [sys.executable, "-c", BARE, src],
        "validate": [*trellis, "validate", src],
        "inspect --json": [*trellis, "inspect", src, "--json"],
        "fit --tp 4 --gpu rtx-pro-6000": [*trellis, "fit", src, "--tp", "4", "--gpu", "rtx-pro-6000"],
        "diff SRC COPY": [*trellis, "diff", src, copy],
        "repack --dry-run": [*trellis, "repack", src, out, "--dry-run"],
    }


def measure(argv: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes, exit code) of one child process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(child.pid, 0)
    return time.perf_counter() - start, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("copy")
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs = commands(args.src, args.copy, args.out)
    best: dict[str, tuple[float, int, int]] = {}
    for argv in runs.values():  # untimed: bytecode written, files in the page cache
        measure(argv)
    for _ in range(args.rounds):
        for name, argv in runs.items():
            wall, rss, code = measure(argv)
            if name not in best or wall < best[name][0]:
                best[name] = (wall, rss, code)
    bare = best["bare json.loads of every header"][0]
    print(f"load average {os.getloadavg()[0]:.2f}, best of {args.rounds}")
    print("| command | exit | wall s | x bare | peak RSS MB |")
    print("|---|---:|---:|---:|---:|")
    for name, (wall, rss, code) in best.items():
        print(f"| {name} | {code} | {wall:.2f} | {wall / bare:.2f} | {rss / 1e6:.0f} |")


if __name__ == "__main__":
    main()
