"""The CLI's progress display draws from its updates, not from a thread: while it is shown the command stays one
thread, which is what lets the reader fork its shard scans (`reader.scan_shards`) in an interactive run."""

from __future__ import annotations

import io
import threading

from rich.console import Console

from trellis_cli.cli.progress import Bars, bars


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=120, color_system=None), out


def test_a_shown_display_starts_no_thread_and_draws_its_updates():
    console, out = _terminal()
    before = threading.active_count()
    with bars(console, bytes_mode=False) as progress:
        assert isinstance(progress, Bars)
        task = progress.add_task("reading headers (files)", total=76, items=True)
        progress.update(task, completed=3, total=76)
        assert threading.active_count() == before  # no refresh thread of its own
        assert "3/76" in out.getvalue()  # the first update is drawn at once
        progress._drawn = 0.0  # (the next update is due: drawn too)
        progress.advance(task, 4)
        assert "7/76" in out.getvalue()
    assert threading.active_count() == before


def test_updates_closer_than_a_redraw_apart_are_drawn_by_the_next_one_due():
    console, out = _terminal()
    with bars(console, bytes_mode=True) as progress:
        task = progress.add_task("hashing", total=100, items=True)
        progress.update(task, completed=10)
        drawn = out.getvalue()
        progress.update(task, completed=20)  # within 1/REDRAWS_PER_SECOND of the last: not drawn yet
        assert "20/100" not in out.getvalue()[len(drawn):]
        progress._drawn = 0.0
        progress.update(task, completed=30)
        assert "30/100" in out.getvalue()[len(drawn):]
