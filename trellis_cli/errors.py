"""Expected failures, by what went wrong, and the exit codes of the CLI.

A leaf module: it imports nothing from trellis_cli, so every layer can raise these. Only the CLI turns
them into a one-line message and an exit code (its table: cli/exit_codes.py); library code never prints or
exits.
"""

from __future__ import annotations

from typing import Any

EXIT_FINDINGS = 1
EXIT_USAGE = 2
EXIT_SOURCE = 3
EXIT_GPU = 4
EXIT_MARGINAL = 5  # trellis fit: fits at the cheap end of the measured terms' band, not at the expensive end
EXIT_INTERRUPTED = 130


class TrellisError(Exception):
    """An expected failure: shown as one line (no traceback unless --debug)."""

    # Whether lines after the first are details worth showing (a compiler log). Otherwise a line break in
    # the message came from data, such as a tensor name, and is shown escaped so the error stays one line.
    multiline = False


class CheckFailed(TrellisError):
    """A check the user asked for did not pass (bad checkpoint data, verification mismatch).

    `code`: the finding code this failure stands for when a caller reports it as a finding (docs/findings.md),
    set where the failure is known (a HeaderError's own code, "file.unreadable", "json.too-large"); None
    leaves the choice to the caller. Never recovered from the message text.
    """

    def __init__(self, *args: object, code: str | None = None) -> None:
        super().__init__(*args)
        self.code = code


class UsageError(TrellisError):
    """Option combinations the argument parser cannot express, or arguments that make no sense together."""


class SourceUnavailable(TrellisError):
    """The checkpoint cannot be reached: missing path, Hub 401/404, bad revision, offline and not cached."""


class GpuUnavailable(TrellisError):
    """No CUDA device, no nvcc, or the kernel build failed (the compiler's output follows the first line)."""

    multiline = True


class UnknownDialect(CheckFailed):
    """The directory is not a checkpoint dialect trellis understands (refused, never guessed)."""


class ValidationFailed(CheckFailed):
    """Raised when validation found errors: by `validate` (which has printed the report already) and by
    stages that require a valid checkpoint (repack), which pass `list_errors=True` so that the message's
    following lines say what is wrong."""

    MAX_LISTED = 10
    multiline = True  # the listed findings follow the summary; their own line breaks are escaped below

    def __init__(self, report: Any, *, list_errors: bool = False) -> None:  # report: findings.Report (a leaf module)
        lines = [report.summary()]
        if list_errors:
            errors = report.errors
            lines += [f"  {finding.line()}".replace("\n", "\\n") for finding in errors[:self.MAX_LISTED]]
            shown = sum(f.count for f in errors[:self.MAX_LISTED])
            if report.error_count > shown:
                lines.append(f"  ... and {report.error_count - shown} more; run `trellis validate "
                             f"{_source_of(report)}` for the full report")
        super().__init__("\n".join(lines))
        self.report = report


def _source_of(report: Any) -> str:
    """What to pass to `trellis validate` again: the local path or Hub repo id the report was made for."""
    source = report.context.get("source")
    if isinstance(source, dict):
        return str(source.get("path") or source.get("repo_id") or "SOURCE")
    return "SOURCE"
