"""The progress bars a command draws on a terminal: rich.progress, imported only where one is drawn
(`output.make_progress` hands every other command a stand-in that shows nothing)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text


def bars(console: Console, bytes_mode: bool) -> Progress:
    """A rich progress on `console`, its bars gone once it is done."""
    columns: list = [SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn()]
    if bytes_mode:  # "1.2/3.4 GB" (a total once known), then the rate; "3/76" for a task added with items=True
        columns += [AmountColumn(default_bytes=True), ByteRateColumn()]
    else:  # counts, or bytes for a task added with bytes=True (hashing within a run of rules)
        columns += [AmountColumn()]
    columns += [TimeElapsedColumn(), TimeRemainingColumn()]
    return Bars(*columns, console=console, transient=True)


class Bars(Progress):
    """A Progress redrawn by its updates (at most REDRAWS_PER_SECOND), not by a thread of its own: while it is
    shown the command stays one thread, so the reader may fork its shard scans (`reader.scan_shards` forks only
    a process of one thread: a fork copies no other thread, and a lock one of them held would never be freed)."""

    REDRAWS_PER_SECOND = 10

    def __init__(self, *columns, **options) -> None:
        super().__init__(*columns, auto_refresh=False, **options)
        self._drawn = 0.0

    def update(self, task_id, **fields) -> None:
        super().update(task_id, **fields)
        self._redraw()

    def advance(self, task_id, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._redraw()

    def _redraw(self) -> None:
        now = time.monotonic()
        if now - self._drawn >= 1 / self.REDRAWS_PER_SECOND:
            self._drawn = now
            self.refresh()


class ByteRateColumn(TransferSpeedColumn):
    """The byte rate, left blank for a task that counts items."""

    def render(self, task):
        return Text("") if task.fields.get("items") else super().render(task)


class AmountColumn(MofNCompleteColumn):
    """"3/76" for a task counting items; "1.2/3.4 GB" for one added with the field bytes=True."""

    def __init__(self, default_bytes: bool = False) -> None:
        super().__init__()
        self._bytes = DownloadColumn()
        self._default_bytes = default_bytes

    def render(self, task):
        as_bytes = task.fields.get("bytes", self._default_bytes and not task.fields.get("items"))
        return self._bytes.render(task) if as_bytes else super().render(task)
