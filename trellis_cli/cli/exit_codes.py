"""The one table from failures to exit codes (0 ok, 1 findings / failed check / I-O error, 2 usage,
3 source unavailable, 4 no GPU / toolkit / build, 130 interrupted): library exceptions say what went wrong,
the CLI decides what the shell sees. The first row whose type matches wins, so subclasses come first."""

from __future__ import annotations

from trellis_cli.errors import (EXIT_FINDINGS, EXIT_GPU, EXIT_SOURCE, EXIT_USAGE, CheckFailed, GpuUnavailable,
                                SourceUnavailable, TrellisError, UsageError)

EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (UsageError, EXIT_USAGE),
    (SourceUnavailable, EXIT_SOURCE),
    (GpuUnavailable, EXIT_GPU),
    (CheckFailed, EXIT_FINDINGS),
    (TrellisError, EXIT_FINDINGS),
    (OSError, EXIT_FINDINGS),
)


def exit_code(err: BaseException) -> int:
    return next((code for kind, code in EXIT_CODES if isinstance(err, kind)), EXIT_FINDINGS)
