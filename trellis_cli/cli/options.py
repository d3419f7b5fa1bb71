"""Options shared by every command that reads a checkpoint, defined once."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

_PANEL = "Source"

SourceArg = Annotated[
    Optional[str],
    typer.Argument(help="Checkpoint directory, or Hub id org/name or org/name@rev (default: the bundled sample)."),
]
RevisionOpt = Annotated[
    Optional[str], typer.Option(help="Hub revision (branch, tag or sha); resolved once to a commit sha.",
                                rich_help_panel=_PANEL)
]
TokenOpt = Annotated[
    Optional[str], typer.Option(help="Hub token (default: HF_TOKEN or the stored `hf auth login` token).",
                                rich_help_panel=_PANEL, show_default=False)
]
OfflineOpt = Annotated[
    bool, typer.Option("--offline", help="Use only the local Hub cache (also HF_HUB_OFFLINE=1).", rich_help_panel=_PANEL)
]
EndpointOpt = Annotated[
    Optional[str], typer.Option(help="Hub endpoint URL (default: HF_ENDPOINT or the public Hub).", rich_help_panel=_PANEL)
]
CacheDirOpt = Annotated[
    Optional[Path], typer.Option(help="Hub cache directory (default: HF_HUB_CACHE).", rich_help_panel=_PANEL)
]


def open_cli_source(source: str | None, revision: str | None = None, token: str | None = None,
                    offline: bool = False, endpoint: str | None = None, cache_dir: Path | None = None):
    """Open SOURCE with the shared options; offline=False leaves the decision to HF_HUB_OFFLINE."""
    from trellis_cli.sources import open_source

    return open_source(source, revision=revision, token=token, cache_dir=cache_dir, endpoint=endpoint,
                       offline=True if offline else None)


def load_numpy_with_one_blas_thread() -> None:
    """numpy's BLAS starts a pool of threads as it loads, and they spin a while on the cores the scan workers read
    with (~30 ms of fit's 0.7 s on two cores); no command multiplies a matrix with numpy, so every command loads it
    with one as it is invoked (`app.build_command`; help loads none). The variable is put back at once: a library loaded
    later (torch's own BLAS) reads the caller's setting."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        del os.environ["OPENBLAS_NUM_THREADS"]


def parse_layers(text: str | None, option: str = "--layers") -> list[int] | None:
    """`--layers 3-5,40` typed once at the edge: the sorted layer list every library call takes (None: all)."""
    from trellis_cli.selection import parse_layer_ranges

    return None if text is None else parse_layer_ranges(text, option=option)


def engine_option(name: str | None) -> str | None:
    """`--engine NAME` checked at the edge; without it the library's default (the dialect's own profile)."""
    from trellis_cli.validate.engines import DEFAULT, engine_named

    return DEFAULT if name is None else engine_named(name).name
