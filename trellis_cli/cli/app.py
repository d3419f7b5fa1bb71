"""The `trellis` Typer app: global options, command registration, and the one error boundary."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from trellis_cli import __version__
from trellis_cli.cli import output
from trellis_cli.errors import EXIT_FINDINGS, EXIT_USAGE, TrellisError

app = typer.Typer(
    name="trellis",
    help=(
        "Inspect, validate, repack and benchmark mixed-bitrate EXL3 (trellis) MoE checkpoints.\n\n"
        "Exit codes: 0 ok, 1 findings or failed check, 2 usage, 3 source unavailable, 4 no usable GPU/CUDA toolkit."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"trellis {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors (also TRELLIS_DEBUG=1).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only errors and data; no logs or progress.")] = False,
) -> None:
    output.state.debug = output.state.debug or debug
    output.state.quiet = quiet


def _register_commands() -> None:
    # One thin module per command; each exposes `register(app)`. Imported here, not at package import,
    # so that `trellis --help` stays fast and torch-free commands never import torch.
    from trellis_cli.cli import bench_cmd, inspect_cmd, repack_cmd, synth_cmd, validate_cmd

    for module in (inspect_cmd, validate_cmd, repack_cmd, bench_cmd, synth_cmd):
        module.register(app)


_register_commands()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the app and maps failures to one line and an exit code."""
    try:
        app(args=argv, prog_name="trellis", standalone_mode=True)
    except TrellisError as err:
        _report_trellis_error(err)
        raise SystemExit(err.exit_code) from None
    except KeyboardInterrupt:
        output.stderr.print("interrupted", style="bold red")
        raise SystemExit(130) from None
    except OSError as err:
        # Permission denied, disk full, a file vanishing: the system's reason and the file are enough.
        _report_error(output.describe_os_error(err))
        raise SystemExit(EXIT_FINDINGS) from None
    except Exception as err:
        # A bug, not bad input: still one line, with the way to get the traceback.
        what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        _report_error(f"internal error: {what} (run with --debug for the traceback)")
        raise SystemExit(EXIT_FINDINGS) from None


def _report_trellis_error(err: TrellisError) -> None:
    message = str(err) or type(err).__name__
    first, *details = message.split("\n") if err.multiline else [message]
    _report_error(first)
    if not output.state.debug:
        # Multi-line details (a compiler log) follow the one-line summary; the traceback replaces them.
        for line in details:
            output.print_line(line, err=True)


def _report_error(message: str) -> None:
    """`error: <message>` on stderr, escaped (messages quote names from the checkpoint); the traceback
    of the exception being handled follows with --debug."""
    output.print_line(f"error: {message}", style="bold red", err=True)
    if output.state.debug:
        output.stderr.print_exception()


__all__ = ["app", "main", "EXIT_USAGE"]
if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
