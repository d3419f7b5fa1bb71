"""Where a kernel's instructions go, read from ncu's source page: per opcode and per straight-line block.

    ncu --clock-control none --kernel-name regex:fc2_wgmma --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --section SourceCounters --page source --csv --print-source sass \
        python3 lab/perf/profile_once.py 512 LIB.so > fc2.csv
    python3 lab/perf/sass_profile.py fc2.csv [--weights 0.805e9] [--top 20] [--blocks 12]

Counts are warp instructions executed. With --weights (the weights the kernel decodes: FC2 of glm52-tp4
at M=512 touches every expert's down projection, 256 x 6144 x 512 = 0.805e9; FC1 twice that) they are
also given per decoded weight and lane (x 32 / weights), the unit of docs/kernel.md's decode budget.
A block is a run of consecutive instructions that executed the same number of times (a loop body, a
chunk's copy issue, an epilogue); the heaviest are listed in address order with their share of the stall
samples and their commonest opcodes.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Line:
    address: int
    opcode: str
    executed: int
    samples: int


@dataclass
class Block:
    start: int
    executed: int
    opcodes: Counter = field(default_factory=Counter)
    samples: int = 0

    @property
    def length(self) -> int:
        return sum(self.opcodes.values())


def opcode(source: str) -> str:
    """The instruction's opcode without its predicate guard and modifiers: '@!P0 LDS.U16 R1, [R2]' -> 'LDS'."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def read_lines(path: str) -> tuple[str, list[Line]]:
    """The kernel's name and its SASS lines from one kernel's ncu source-page CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(row for row in f if row.startswith('"')))
    kernel = next((row[1] for row in rows if row and row[0] == "Kernel Name"), "?")
    header = next((row for row in rows if row and row[0] == "Address"), None)
    if header is None:
        sys.exit(f"{path}: no ncu source page (a header row starting with \"Address\"); see this script's usage")
    col = {name: i for i, name in enumerate(header)}
    lines = []
    for row in rows:
        if len(row) != len(header) or row[0] == "Address":
            continue
        count = [int(row[col[name]].replace(",", "") or 0)
                 for name in ("Instructions Executed", "Warp Stall Sampling (All Samples)")]
        lines.append(Line(int(row[col["Address"]], 0), opcode(row[col["Source"]]), *count))
    lines.sort(key=lambda line: line.address)
    return kernel, lines


def blocks_of(lines: list[Line]) -> list[Block]:
    blocks: list[Block] = []
    for line in lines:
        if not blocks or blocks[-1].executed != line.executed:
            blocks.append(Block(line.address, line.executed))
        blocks[-1].opcodes[line.opcode] += 1
        blocks[-1].samples += line.samples
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("csv")
    parser.add_argument("--weights", type=float, default=0.0, help="weights the kernel decodes")
    parser.add_argument("--top", type=int, default=20, help="opcodes to list")
    parser.add_argument("--blocks", type=int, default=12, help="heaviest blocks to list")
    args = parser.parse_args()
    kernel, lines = read_lines(args.csv)
    total = sum(line.executed for line in lines)
    samples = max(1, sum(line.samples for line in lines))
    per_weight = 32 / args.weights if args.weights else 0.0
    unit = "per weight" if per_weight else "share"

    def scale(n: int) -> float:  # per decoded weight and lane, or the share of all instructions
        return n * per_weight if per_weight else n / max(1, total)

    print(kernel)
    print(f"{total:,} warp instructions" + (f", {total * per_weight:.2f} per decoded weight" if per_weight else ""))
    executed, sampled = Counter(), Counter()
    for line in lines:
        executed[line.opcode] += line.executed
        sampled[line.opcode] += line.samples
    print(f"\n{'opcode':<10} {unit:>10} {'stalls %':>9}")
    for op, n in executed.most_common(args.top):
        print(f"{op:<10} {scale(n):>10.3f} {100 * sampled[op] / samples:>9.1f}")

    heaviest = sorted(blocks_of(lines), key=lambda b: b.executed * b.length, reverse=True)[:args.blocks]
    print(f"\n{'address':>10} {'length':>6} {'executed':>10} {unit:>10} {'stalls %':>9}  opcodes")
    for b in sorted(heaviest, key=lambda b: b.start):
        common = " ".join(f"{op} {n}" for op, n in b.opcodes.most_common(6))
        print(f"{b.start & 0xFFFFF:>#10x} {b.length:>6} {b.executed:>10,} {scale(b.executed * b.length):>10.3f} "
              f"{100 * b.samples / samples:>9.1f}  {common}")


if __name__ == "__main__":
    main()
