"""Where output goes: data on stdout, logs and progress on stderr, one JSON document with --json."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


@dataclass
class State:
    """Global flags, set once by the app callback."""

    debug: bool = os.environ.get("TRELLIS_DEBUG", "") not in ("", "0")
    quiet: bool = False


state = State()

# Wide enough for tensor names; rich falls back to 80 columns when not a terminal.
stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def emit_json(document: Any) -> None:
    """Print one JSON document on stdout, nothing else (no colour, no markup)."""
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def log(message: str) -> None:
    """A progress/log line on stderr (silenced by --quiet)."""
    if not state.quiet:
        stderr.print(message, markup=False, highlight=False)


def progress_enabled(as_json: bool = False) -> bool:
    return not (state.quiet or as_json) and stderr.is_terminal


def make_progress(*, bytes_mode: bool = False, enabled: bool = True) -> Progress:
    """A rich progress bar on stderr; disabled when quiet, in JSON mode or not on a terminal."""
    columns: list = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn()]
    if bytes_mode:
        columns += [DownloadColumn(), TransferSpeedColumn()]
    else:
        columns += [MofNCompleteColumn()]
    columns.append(TimeRemainingColumn())
    return Progress(*columns, console=stderr, transient=True, disable=not enabled)


@contextmanager
def progress_bar(description: str, total: float | None, *, bytes_mode: bool = False,
                 enabled: bool = True) -> Iterator[Any]:
    """Yield an `advance(n)` callable driving one progress task."""
    with make_progress(bytes_mode=bytes_mode, enabled=enabled) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)
