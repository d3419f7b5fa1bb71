"""`trellis inspect`: placeholder until its module lands."""

from __future__ import annotations

import typer

from trellis_cli.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command("inspect")
    def inspect_command() -> None:
        """Not available yet."""
        raise UsageError("trellis inspect is not available yet")
