"""Where output goes: data on stdout, logs and progress on stderr, one JSON document with --json."""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, cast

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID


@dataclass
class State:
    """Global flags, set once by the app callback."""

    debug: bool = os.environ.get("TRELLIS_DEBUG", "") not in ("", "0")
    quiet: bool = False


state = State()


def _console(stream, **kwargs) -> Console:
    # Text we print carries checkpoint-derived names, so rich must not read `[bold]` as markup, `:x:` as an
    # emoji or colour numbers. Lines soft-wrap (tensor names stay whole). Piped into a log, rich would fit
    # tables into 80 columns and cut their numbers to "184…"; without a terminal (or COLUMNS) they get 200.
    width = None if stream.isatty() or os.environ.get("COLUMNS") else 200
    return Console(soft_wrap=True, markup=False, emoji=False, highlight=False, width=width, **kwargs)


stdout = _console(sys.stdout)
stderr = _console(sys.stderr, stderr=True)

# Characters a terminal acts on rather than shows: C0 and C1 controls (newline, ESC, CR...), DEL, lone
# surrogates (not encodable), line/paragraph separators and bidi overrides (reorder what is displayed).
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """`text` safe for a terminal: every character it would act on becomes a visible \\xNN or \\uXXXX escape.

    Names in a checkpoint (tensors, files, JSON keys) are untrusted; a name holding "\\n\\x1b[2K\\rPASS" must
    not forge a line of output.
    """
    return _UNPRINTABLE.sub(_escape, str(text))


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def cell(text: object) -> Text:
    """A rich table cell or title that is shown as is: escaped, never parsed as markup."""
    return Text(printable(text))


class PipeGuard:
    """sys.stdout (and sys.stderr) while a command runs. Once the reader of a pipe has gone (`trellis inspect |
    head -c 1`), the rest of the output goes to the null device and the command ends with its own exit code,
    silently: text (written line by line) and --json (one write) then end alike."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._discard_rest()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard_rest()

    def _discard_rest(self) -> None:
        # The descriptor itself is pointed at the null device, so the interpreter's last flush at exit (of
        # what is still buffered) cannot fail either.
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def print_line(text: object, *, style: str | None = None, err: bool = False) -> None:
    """One line of data on stdout (or stderr), escaped."""
    (stderr if err else stdout).print(printable(text), style=style)


def describe_os_error(err: OSError) -> str:
    """`<file>: <reason>` for an error the operating system reported (`<file> -> <file2>` for a rename)."""
    reason = err.strerror or str(err)
    names = [os.fsdecode(n) if isinstance(n, (bytes, os.PathLike)) else str(n)
             for n in (err.filename, err.filename2) if n is not None]
    return f"{' -> '.join(names)}: {reason}" if names else reason


def emit_json(document: Any, *, streamed: tuple[str, Iterable[Any]] | None = None) -> None:
    """Print one JSON document on stdout, nothing else (no colour, no markup).

    `streamed=(key, items)` adds the top-level array `key`, written item by item: a report with 100,000
    findings is never held as one string."""
    if streamed is None:
        sys.stdout.write(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n")
        sys.stdout.flush()
        return
    key, items = streamed
    text = json.dumps(document, indent=2, sort_keys=False, default=str)
    head = text[:text.rstrip().rindex("}")].rstrip()  # the document without its closing brace
    sys.stdout.write(f"{head}{',' if document else ''}\n  {json.dumps(key)}: [")
    for n, item in enumerate(items):
        body = json.dumps(item, indent=2, sort_keys=False, default=str).replace("\n", "\n    ")
        sys.stdout.write(f"{',' if n else ''}\n    {body}")
    sys.stdout.write("\n  ]\n}\n")
    sys.stdout.flush()


def log(message: str) -> None:
    """A progress/log line on stderr (silenced by --quiet)."""
    if not state.quiet:
        print_line(message, err=True)


def progress_enabled(as_json: bool = False) -> bool:
    return not (state.quiet or as_json) and stderr.is_terminal


def make_progress(*, bytes_mode: bool = False, enabled: bool = True) -> Progress | Unshown:
    """A rich progress bar on stderr (cli/progress.py); where it would be disabled (quiet, JSON mode, not a terminal)
    a stand-in that shows nothing, so that a command drawing no bar never imports rich.progress."""
    if not enabled:
        return Unshown()
    from trellis_cli.cli.progress import bars

    return bars(stderr, bytes_mode)


class Unshown:
    """A progress that is not shown: the calls the commands make of rich's Progress, each doing nothing."""

    def __enter__(self) -> Unshown:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_task(self, description: str, total: float | None = None, **fields: Any) -> TaskID:
        return cast("TaskID", 0)

    def update(self, task: TaskID, **fields: Any) -> None:
        return None

    def advance(self, task: TaskID, advance: float = 1) -> None:
        return None


@contextmanager
def progress_bar(description: str, total: float | None, *, bytes_mode: bool = False,
                 enabled: bool = True) -> Iterator[Any]:
    """Yield an `advance(n)` callable driving one progress task."""
    with make_progress(bytes_mode=bytes_mode, enabled=enabled) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


STAGE_NAMES = {"files": "reading headers (files)", "model": "building the checkpoint model (steps)",
               "headers": "header rules (layers)", "data": "data rules (layers)"}


def stage_advancer(progress: Progress | Unshown) -> Callable[[str, int, int], None]:
    """`advance(stage, done, total)` on `progress`: one bar per stage, each with its total (files, layers,
    steps), counted as items even in a progress whose other tasks count bytes."""
    tasks: dict[str, Any] = {}

    def advance(stage: str, done: int, total: int) -> None:
        if stage not in tasks:
            tasks[stage] = progress.add_task(STAGE_NAMES.get(stage, f"{stage} rules"), total=total, items=True)
        progress.update(tasks[stage], completed=done, total=total)

    return advance


@contextmanager
def stage_progress(enabled: bool = True) -> Iterator[Any]:
    """Yield `advance(stage, done, total)` (see `stage_advancer`) with its Progress as `advance.progress`."""
    with make_progress(enabled=enabled) as progress:
        advance = stage_advancer(progress)
        advance.progress = progress  # type: ignore[attr-defined]  # for a caller adding its own task
        yield advance


def print_checks(checks, title: str) -> None:
    """A table of pass/fail checks (name, case, value against limit) on stdout: bench --smoke's report."""
    from rich.table import Table

    table = Table(title=title)
    for column in ("check", "case", "value", "limit", "result"):
        table.add_column(column)
    for c in checks:
        value = "" if c.value is None else f"{c.value:.3e}"
        limit = "" if c.limit is None else f"{c.limit:.0e}"
        table.add_row(cell(c.name), cell(c.case), value, limit, "PASS" if c.passed else "FAIL")
    stdout.print(table)
