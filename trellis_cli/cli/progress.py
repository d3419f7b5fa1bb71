"""The progress bars a command draws on a terminal: rich.progress, imported only where one is drawn
(`output.make_progress` hands every other command a stand-in that shows nothing)."""

from __future__ import annotations

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
    return Progress(*columns, console=console, transient=True)


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
