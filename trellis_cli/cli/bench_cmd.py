"""`trellis bench`: placeholder until its module lands."""

from __future__ import annotations

import typer

from trellis_cli.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench_command() -> None:
        """Not available yet."""
        raise UsageError("trellis bench is not available yet")
