"""Fixtures the CLI tests share."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from trellis_cli.cli import output


@pytest.fixture
def terminal(monkeypatch):
    """stderr as a terminal (progress is drawn only there), recorded."""
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=200, color_system=None, markup=False,
                      emoji=False, highlight=False)
    monkeypatch.setattr(output, "stderr", console)
    return buffer
