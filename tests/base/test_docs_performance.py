"""docs/performance.md stays a current-state page: at most 300 lines, its history in docs/perf-log/, and
every link from the page to the log leads to a file that is there."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = DOCS / "performance.md"
MAX_LINES = 300


def test_performance_page_is_short():
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, (
        f"docs/performance.md has {len(lines)} lines (at most {MAX_LINES}): move history to docs/perf-log/ "
        "(a dated file, verbatim) and keep the current state here")


def test_links_to_the_log_resolve():
    text = PAGE.read_text(encoding="utf-8")
    targets = re.findall(r"\]\((perf-log/[^)#\s]+)", text)
    assert targets, "the page cites its history in perf-log/"
    missing = sorted({t for t in targets if not (DOCS / t).is_file()})
    assert not missing, missing


def test_every_log_file_is_indexed():
    log = DOCS / "perf-log"
    index = (log / "README.md").read_text(encoding="utf-8")
    unlisted = sorted(p.name for p in log.glob("*.md") if p.name != "README.md" and f"({p.name})" not in index)
    assert not unlisted, unlisted
