"""Entry points that join two work packages, so that neither imports the other (inspect's: inspect_request.py).

`run_repack` is repack.run.run_repack handed validate.run_validation as its validator, with the format rules
alone deciding (no engine profile enforced: a repack changes the layout a loader sees): the source is
validated before anything is written (unless `options.validate` is off) and a staged exl3-v1 output must
validate before it is moved into place. The CLI (`trellis repack`) and the library API call this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.findings import Report
from trellis_cli.dialects.conversion import RepackResult
from trellis_cli.repack.run import RepackOptions
from trellis_cli.sources import SourceArg


def run_repack(source: SourceArg | Checkpoint, out: str | Path, options: RepackOptions | None = None, *,
               on_bytes: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None,
               log: Callable[[str], None] | None = None,
               on_stage: Callable[[str, int, int], None] | None = None) -> RepackResult:
    """Repack `source` (a Source, a path, or an opened Checkpoint) into `out`, validated (repack/run.py).

    `on_stage(stage, done, total)` follows opening the source and validating it (headers, model, rules)."""
    from trellis_cli.repack.run import run_repack as repack
    from trellis_cli.validate import run_validation

    def validator(checkpoint: Checkpoint) -> Report:
        return run_validation(checkpoint, engine=None, progress=on_stage)

    return repack(source, out, options, validator=validator, on_bytes=on_bytes, on_total=on_total, log=log,
                  on_stage=on_stage)


__all__ = ["run_repack"]
