"""The one table from failures to exit codes and hints (0 ok, 1 findings / failed check / I-O error, 2 usage,
3 source unavailable, 4 no GPU / toolkit / build, 5 `fit`'s marginal verdict, set by the command itself,
130 interrupted): library exceptions say what went wrong,
the CLI decides what the shell sees and what to try next. The first row whose type matches wins, so
subclasses come first. A hint is shown as one `hint:` line after the `error:` line; `{command}` in it is the
command that ran (`trellis validate`)."""

from __future__ import annotations

from typing import NamedTuple

from trellis_cli.errors import (EXIT_FINDINGS, EXIT_GPU, EXIT_SOURCE, EXIT_USAGE, CheckFailed, GpuUnavailable,
                                SourceUnavailable, TrellisError, UsageError)


class ExitRow(NamedTuple):
    kind: type[BaseException]
    code: int
    hint: str | None  # None where the message already says all there is to do


EXIT_CODES: tuple[ExitRow, ...] = (
    ExitRow(UsageError, EXIT_USAGE, "see `{command} --help`"),
    ExitRow(SourceUnavailable, EXIT_SOURCE,
            "check the path, or the repo id, revision, token and network; "
            "--offline reads a snapshot already in the cache"),
    ExitRow(GpuUnavailable, EXIT_GPU,
            "without a GPU, `trellis bench --plan` checks launch plans and `trellis bench --compile-only` "
            "builds the kernels (it needs nvcc)"),
    ExitRow(CheckFailed, EXIT_FINDINGS, None),
    ExitRow(TrellisError, EXIT_FINDINGS, None),
    ExitRow(OSError, EXIT_FINDINGS, None),
)


def _row(err: BaseException) -> ExitRow | None:
    return next((row for row in EXIT_CODES if isinstance(err, row.kind)), None)


def exit_code(err: BaseException) -> int:
    row = _row(err)
    return row.code if row is not None else EXIT_FINDINGS


def hint(err: BaseException, command: str = "trellis") -> str | None:
    """What to try next after `err`, for the command that ran; None when the table has nothing to add."""
    row = _row(err)
    if row is None or row.hint is None:
        return None
    return row.hint.replace("{command}", command)
