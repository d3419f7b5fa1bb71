"""File names, one rule for every dialect: each file the checkpoint's listing holds must be a plain relative
name that stays inside the checkpoint (a link leading out is never read), and must not be a dangling link.

What a dialect's opening or its own verification already reports by name is left to it, so no file is
reported twice: the shards the shared shard reader parses, an exl3-v1's layer files, a route pack's listed
files (`Dialect.names_reported`). Everything else is checked here, whatever the dialect.
"""

from __future__ import annotations

from typing import Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import Dialect
from trellis_cli.findings import Finding, Location, error
from trellis_cli.header import safe_relative


def check_names(ckpt: Checkpoint, dialect: Dialect) -> Iterator[Finding]:
    reported = dialect.names_reported(ckpt)
    for name, size in ckpt.files.items():
        if name in reported:
            continue
        if not safe_relative(name):
            yield error("path.escape", Location(file=name), "file resolves outside the checkpoint directory")
        elif ckpt.source.escapes(name):
            yield error("path.escape", Location(file=name), "file resolves outside the checkpoint directory "
                        "(symlink)")
        elif size < 0:
            yield error("path.dangling", Location(file=name), "file is a dangling link (or a symlink loop)")
