"""Sets of expert or layer ids as compact text: [0, 1, 2, 3, 9, 12, 13] <-> "0-3,9,12-13".

The form tier membership takes in inspect output and in the route-pack manifest.
"""

from __future__ import annotations

import re

# Far more experts or layers than any model has (GLM-5.2: 256 experts); bounds what expand_ranges builds.
MAX_IDS = 1 << 20

# ASCII digits only: str.isdigit() and int() accept other scripts' digits and superscripts differently.
_RANGE = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")
# An id as a loader spells it (`str(layer)`, `f"experts.{e}"`): ASCII decimal, no sign, no leading zero. A loader
# looks names and JSON keys up by that exact string, so `007`, `٣` or `３` name nothing to it.
CANONICAL_ID = r"(?:0|[1-9][0-9]*)"
_CANONICAL_ID = re.compile(CANONICAL_ID)


def parse_id(text: object) -> int | None:
    """The id a canonical decimal string names ("7" -> 7); None for anything a loader would not look up as
    that id ("07", "٣", "+7", " 7", 7 as a non-string)."""
    return int(text) if isinstance(text, str) and _CANONICAL_ID.fullmatch(text) else None


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


def expand_ranges(text: str, *, limit: int = MAX_IDS) -> list[int]:
    """Inverse of compact_ranges; raises ValueError on malformed text or when it names more than `limit` ids
    (the text may come from an untrusted manifest, where "0-99999999999" must not exhaust memory)."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, last = parse_range(part)
        if len(out) + (last - first + 1) > limit:
            raise ValueError(f"id ranges name more than {limit} ids (at {part!r})")
        out.extend(range(first, last + 1))
    return out


def parse_range(part: str) -> tuple[int, int]:
    """"3-5" -> (3, 5), "7" -> (7, 7); ValueError unless ASCII digits, low to high."""
    match = _RANGE.fullmatch(part)
    if not match:
        raise ValueError(f"{part!r} is not an id or a range like 3-5")
    first, last = int(match[1]), int(match[2] or match[1])
    if last < first:
        raise ValueError(f"range {part!r} runs backwards")
    return first, last


def range_bounds(text: str) -> list[tuple[int, int]]:
    """"0,2-4" -> [(0, 0), (2, 4)] without expanding them (an untrusted manifest may say "0-99999999999").

    Raises ValueError unless the ranges are well formed, ascending and disjoint, as compact_ranges writes them.
    """
    bounds: list[tuple[int, int]] = []
    for part in text.split(",") if text else []:
        first, last = parse_range(part)
        if bounds and first <= bounds[-1][1]:
            raise ValueError(f"{part!r} is not ascending after the ranges before it")
        bounds.append((first, last))
    return bounds
