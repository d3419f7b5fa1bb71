"""Expected failures and the exit code each maps to.

A leaf module: it imports nothing from trellis_cli, so every layer can raise these. Only the CLI turns
them into a one-line message and an exit code; library code never prints or exits.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_SOURCE = 3
EXIT_GPU = 4


class TrellisError(Exception):
    """An expected failure: shown as one line (no traceback unless --debug), mapped to an exit code."""

    exit_code = EXIT_FINDINGS
    # Whether lines after the first are details worth showing (a compiler log). Otherwise a line break in
    # the message came from data, such as a tensor name, and is shown escaped so the error stays one line.
    multiline = False


class CheckFailed(TrellisError):
    """A check the user asked for did not pass (bad checkpoint data, verification mismatch)."""

    exit_code = EXIT_FINDINGS


class UsageError(TrellisError):
    """Option combinations the argument parser cannot express, or arguments that make no sense together."""

    exit_code = EXIT_USAGE


class SourceUnavailable(TrellisError):
    """The checkpoint cannot be reached: missing path, Hub 401/404, bad revision, offline and not cached."""

    exit_code = EXIT_SOURCE


class GpuUnavailable(TrellisError):
    """No CUDA device, no nvcc, or the kernel build failed (the compiler's output follows the first line)."""

    exit_code = EXIT_GPU
    multiline = True


class UnknownDialect(CheckFailed):
    """The directory is not a checkpoint dialect trellis understands (refused, never guessed)."""


class ValidationFailed(CheckFailed):
    """Raised by stages that require a valid checkpoint (repack, bench) when validation found errors."""

    def __init__(self, report) -> None:  # report: findings.Report (not imported: this module is a leaf)
        super().__init__(report.summary())
        self.report = report
