"""OUT kept apart from everything the source is made of (the paths come from dialects/source_facts.py
`source_paths`): OUT, its stage and the lock file never equal, lie inside or contain one of them, since
`--overwrite` deletes OUT and a stage is deleted and rebuilt. Output names are checked by
dialects/conversion.py `output_name`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from trellis_cli.errors import UsageError


def check_overlap(out: Path, stage: Path, protected: Iterable[Path], lock: Path | None = None) -> None:
    """Refuse an OUT (or its stage, OUT.partial) that equals, lies inside or contains a protected path, and a
    lock file (OUT.partial.lock) that would be one of them or lie inside one."""
    real_out, real_stage = out.resolve(), stage.resolve()
    for path in protected:
        src = Path(os.path.realpath(path))
        if lock is not None and Path(os.path.realpath(lock)).is_relative_to(src):
            raise UsageError(f"{lock}: the lock file of {out} would be written at or inside the source {src}; "
                             f"refusing to write into the source")
        if real_out == src or real_out.is_relative_to(src):
            raise UsageError(f"{out}: is inside the source {src} (the checkpoint, a file it is made of, or the Hub "
                             f"cache holding it); refusing to write into the source")
        if src.is_relative_to(real_out):
            raise UsageError(f"{out}: contains the source {src} (the checkpoint, a file it is made of, or the Hub "
                             f"cache holding it); refusing to replace it")
        if real_stage == src or src.is_relative_to(real_stage) or real_stage.is_relative_to(src):
            raise UsageError(f"{stage}: the staging directory of {out} overlaps the source {src}; refusing (it is "
                             f"deleted and rebuilt); choose another OUT or move the source")
