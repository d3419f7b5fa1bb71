"""Sets of expert or layer ids as compact text: [0, 1, 2, 3, 9, 12, 13] <-> "0-3,9,12-13".

The form tier membership takes in inspect output and in the route-pack manifest.
"""

from __future__ import annotations


def compact_ranges(ids: "list[int]") -> str:
    """Ids (any order, duplicates ignored) as "0-3,9,12-13"; "" when empty."""
    parts: list[str] = []
    ordered = sorted(set(ids))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def expand_ranges(text: str) -> list[int]:
    """Inverse of compact_ranges; raises ValueError on malformed text."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi) if hi else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad id range {part!r}")
        out.extend(range(first, last + 1))
    return out
