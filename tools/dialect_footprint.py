"""The files a change touched outside `trellis_cli/dialects/`, `tests/` and `docs/`: what adding a dialect (a
package under dialects/ and its line in dialects/registry.py, docs/architecture.md "Adding a dialect") should
leave empty.

    python tools/dialect_footprint.py BASE [HEAD]

Lists `git diff --name-only BASE HEAD` (the working tree, untracked files included, when HEAD is left out) less
those three folders. Exit 0 when nothing is left, 1 naming each file otherwise.
"""

from __future__ import annotations

import subprocess
import sys

INSIDE = ("trellis_cli/dialects/", "tests/", "docs/")


def outside(paths: list[str]) -> list[str]:
    """The paths a dialect's change should not touch."""
    return sorted(p for p in paths if p and not p.startswith(INSIDE))


def changed(base: str, head: str | None) -> list[str]:
    def git(*args: str) -> list[str]:
        return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout.splitlines()

    if head is not None:
        return git("diff", "--name-only", base, head)
    return git("diff", "--name-only", base) + git("ls-files", "--others", "--exclude-standard")


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__.strip().splitlines()[3].strip(), file=sys.stderr)
        return 2
    left = outside(changed(argv[0], argv[1] if len(argv) > 1 else None))
    for path in left:
        print(path)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
