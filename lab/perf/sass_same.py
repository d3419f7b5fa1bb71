"""Do two kernel libraries hold the same SASS per kernel, whatever the order of the kernels in them?

    python3 lab/perf/sass_same.py A.so B.so

`cuobjdump -sass` of each, cut into functions by their `Function :` lines; prints how many functions each holds and
the names of those whose code differs or that only one holds. Exit 0 when every function is identical."""

from __future__ import annotations

import re
import subprocess
import sys


def functions(path: str) -> dict[str, str]:
    text = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"\s*Function : (\S+)", line)
        if head:
            current = head.group(1)
            found.setdefault(current, [])
        elif current and line.strip().startswith("/*"):
            found[current].append(line.strip())
    return {name: "\n".join(body) for name, body in found.items()}


def main() -> int:
    a, b = functions(sys.argv[1]), functions(sys.argv[2])
    differing = sorted(n for n in a.keys() & b.keys() if a[n] != b[n])
    alone = sorted(a.keys() ^ b.keys())
    print(f"{len(a)} / {len(b)} functions, {len(differing)} differing, {len(alone)} in one only")
    for name in differing + alone:
        print("  ", name)
    return 1 if differing or alone else 0


if __name__ == "__main__":
    sys.exit(main())
