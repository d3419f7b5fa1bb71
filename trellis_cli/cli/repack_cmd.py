"""`trellis repack`: placeholder until its module lands."""

from __future__ import annotations

import typer

from trellis_cli.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command("repack")
    def repack_command() -> None:
        """Not available yet."""
        raise UsageError("trellis repack is not available yet")
