"""The `trellis` Typer app: global options, command registration, and the one error boundary."""

from __future__ import annotations

import itertools
import logging
import os
import sys
from functools import partial
from typing import Annotated, Any, Callable, NoReturn

import typer

from trellis_cli import __version__
from trellis_cli.cli import output
from trellis_cli.cli.exit_codes import exit_code, hint
from trellis_cli.cli.options import load_numpy_with_one_blas_thread
from trellis_cli.errors import EXIT_FINDINGS, EXIT_INTERRUPTED, EXIT_USAGE, TrellisError

GLOBAL_FLAGS = ("-q", "--quiet", "--debug")  # accepted before or after the subcommand
HELP_OPTION_NAMES = ["-h", "--help"]

app = typer.Typer(
    name="trellis",
    help=(
        "Inspect, validate, repack and benchmark mixed-bitrate EXL3 (trellis) MoE checkpoints.\n\n"
        "Exit codes: 0 ok, 1 findings or failed check, 2 usage, 3 source unavailable, 4 no usable GPU/CUDA toolkit, "
        "130 interrupted.\n\n"
        "Shell completion: `trellis --install-completion` (bash, zsh, fish, PowerShell)."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": HELP_OPTION_NAMES},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"trellis {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    # A plain bool (not Optional): typer converts no bool flag's value (`build_command`).
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors (also TRELLIS_DEBUG=1).")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only errors and data; no logs or progress.")] = False,
) -> None:
    output.state.debug = output.state.debug or debug
    output.state.quiet = quiet


def command_table() -> tuple[tuple[str, Callable[..., None], str], ...]:
    """Every command as (name, function, help), in the order `trellis --help` lists them. Each function is a
    module-level one of its thin cli/<name>_cmd.py module, importable and callable without the app. Imported
    here, not at package import, so that torch-free commands never import torch."""
    from trellis_cli.cli import bench_cmd, diff_cmd, fit_cmd, inspect_cmd, repack_cmd, synth_cmd, validate_cmd

    return (
        ("inspect", inspect_cmd.inspect_command, inspect_cmd.HELP),
        ("validate", validate_cmd.validate_command, validate_cmd.HELP),
        ("repack", repack_cmd.repack_command, repack_cmd.HELP),
        ("bench", bench_cmd.bench_command, bench_cmd.HELP),
        ("synth", synth_cmd.synth_command, synth_cmd.HELP),
        ("diff", diff_cmd.diff_command, diff_cmd.HELP),
        ("fit", fit_cmd.fit_command, fit_cmd.HELP),
    )


COMMANDS = command_table()
for _name, _function, _help in COMMANDS:
    app.command(_name, help=_help)(_function)


def build_command():
    """The click command of the app, with help that reads as the conventions: a flag shows no `<bool>` type,
    an argument its name in capitals (SOURCE, OUT). Built from typer's public `get_command`."""
    import typer.main

    command = typer.main.get_command(app)
    for sub in [command, *getattr(command, "commands", {}).values()]:
        # The help option is made on first use and kept by the command: made here, with the app's names.
        context = sub.context_class(sub, help_option_names=HELP_OPTION_NAMES)
        for param in [*sub.params, sub.get_help_option(context)]:
            if getattr(param, "param_type_name", "") == "option" and getattr(param, "is_flag", False):
                param.metavar = ""
                # typer's own help and completion flags default to None. False reads the same to their callbacks,
                # and typer converts no bool flag's value: help is then rendered without importing pydantic.
                if param.default is None:
                    param.default = False
            elif getattr(param, "param_type_name", "") == "argument" and param.name:
                if param.metavar is None:
                    param.metavar = param.name.upper()
                # The usage line reads `SOURCE OUT` / `[SOURCE]` (click's own convention), not `{SOURCE}`.
                param.get_usage_pieces = partial(_usage_pieces, param)
        if sub is not command:  # a command runs once its arguments are parsed (help has exited by then)
            sub.invoke = partial(_invoke, sub.invoke)
    return command


def _invoke(invoke: Callable[[Any], Any], ctx: Any) -> Any:
    """A command's own invoke, once numpy is loaded with one BLAS thread (`options.load_numpy_with_one_blas_thread`;
    help loads no numpy)."""
    load_numpy_with_one_blas_thread()
    return invoke(ctx)


def _usage_pieces(argument, _ctx) -> list[str]:
    """An argument on the usage line: NAME when required, [NAME] when not, `...` after one that repeats."""
    name = argument.metavar if argument.required else f"[{argument.metavar}]"
    return [name + ("..." if argument.nargs != 1 else "")]


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the app and maps failures to one line and an exit code."""
    command = build_command()  # (once: building it reads every command's signature)
    args = hoist_global_flags(list(sys.argv[1:] if argv is None else argv), command)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = output.PipeGuard(sys.stdout), output.PipeGuard(sys.stderr)
    try:
        _run(args, command)
    except SystemExit as done:
        if argv is not None:  # called in-process (tests, a host program): exit as Python does
            raise
        sys.stdout, sys.stderr = streams
        _exit_now(done.code)
    finally:
        sys.stdout, sys.stderr = streams


def _exit_now(code: object) -> NoReturn:
    """End the process once the command has said everything: what it leaves alive (at production size up to a
    million records of an opened checkpoint) the interpreter's shutdown would free one by one, the system frees at
    once. Nothing of ours waits on exit handlers: the package removes what it creates before its commands return."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, or a closed stream: the exit code is already decided
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else EXIT_FINDINGS)


def _run(args: list[str], command: Any) -> None:
    try:
        # standalone_mode=False: the parser's errors come back to us (one line, not a boxed panel).
        code = command(args=args, prog_name="trellis", standalone_mode=False)
    except _PARSER_ERRORS as err:
        if err.format_message():  # type: ignore[attr-defined]  # empty when bare `trellis` printed the help
            _report_error(_usage_message(err))
        raise SystemExit(getattr(err, "exit_code", EXIT_USAGE)) from None
    except _ABORTS:  # EOF at a prompt, or Ctrl-C while the parser itself ran
        _report_interrupted()
    except TrellisError as err:
        _report_trellis_error(err)
        _report_hint(err, args)
        raise SystemExit(exit_code(err)) from None
    except KeyboardInterrupt:
        _report_interrupted()
    except BrokenPipeError:  # `trellis inspect | head`: the reader left; nothing to say to it
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter's final flush must not fail
        raise SystemExit(EXIT_FINDINGS) from None
    except OSError as err:
        # Permission denied, disk full, a file vanishing: the system's reason and the file are enough.
        _report_error(output.describe_os_error(err))
        _report_hint(err, args)
        raise SystemExit(exit_code(err)) from None
    except Exception as err:
        # A bug, not bad input: still one line, with the way to get the traceback.
        what = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        _report_error(f"internal error: {what} (run with --debug for the traceback)")
        raise SystemExit(EXIT_FINDINGS) from None
    if code == EXIT_INTERRUPTED:  # typer turns Ctrl-C inside a command into Exit(130) without a word
        _report_interrupted()
    raise SystemExit(code if isinstance(code, int) else 0)  # as click's standalone mode: always exits


def _report_interrupted() -> None:
    output.print_line("interrupted (Ctrl-C)", style="bold red", err=True)
    raise SystemExit(EXIT_INTERRUPTED) from None


def _click_exceptions() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """The parser's error and abort classes, those of the click typer runs on: click's own, or the copy newer typer
    vendors. Found through typer's public BadParameter and Abort, never a private module, and without importing
    click (which newer typer never imports)."""
    errors = tuple(k for k in typer.BadParameter.__mro__ if k.__name__ == "ClickException")
    aborts = [getattr(typer, "Abort", None)]
    return errors, tuple(a for a in aborts if isinstance(a, type) and issubclass(a, BaseException))


_PARSER_ERRORS, _ABORTS = _click_exceptions()


def _usage_message(err) -> str:
    """The parser's complaint on one line, naming the command and where its help is."""
    ctx = getattr(err, "ctx", None)
    command = ctx.command_path if ctx is not None else "trellis"
    return f"{command}: {err.format_message()} (see `{command} --help`)"


def hoist_global_flags(args: list[str], group: Any = None) -> list[str]:
    """Move `-q`/`--quiet`/`--debug` given after the subcommand to the front, where the app reads them.

    Walks the subcommand's own options (of `group`, the app's command: built here when not given) so that an
    option's value (`--token -q`) is never taken for a flag, and stops at `--`.
    """
    group = build_command() if group is None else group
    sub_index = next((i for i, a in enumerate(args) if not a.startswith("-")), None)
    command = getattr(group, "commands", {}).get(args[sub_index]) if sub_index is not None else None
    if sub_index is None or command is None:
        return args
    # Duck-typed: typer may hand back click's classes or those of its vendored copy.
    takes_value = {name for param in command.params
                   if getattr(param, "param_type_name", "") == "option" and not getattr(param, "is_flag", False)
                   for name in (*param.opts, *param.secondary_opts)}
    head, hoisted, rest = args[:sub_index + 1], [], []
    tail = iter(args[sub_index + 1:])
    for arg in tail:
        if arg == "--":
            rest += [arg, *tail]
            break
        if arg in GLOBAL_FLAGS:
            hoisted.append(arg)
            continue
        rest.append(arg)
        if arg in takes_value:
            rest += list(itertools.islice(tail, 1))
    if not hoisted:
        return args
    return hoisted + head + rest


def _report_trellis_error(err: TrellisError) -> None:
    message = str(err) or type(err).__name__
    first, *details = message.split("\n") if err.multiline else [message]
    _report_error(first)
    if not output.state.debug:
        # Multi-line details (a compiler log) follow the one-line summary; the traceback replaces them.
        for line in details:
            output.print_line(line, err=True)


def _report_hint(err: BaseException, args: list[str]) -> None:
    """The table's `hint:` line for `err` (cli/exit_codes.py), naming the command that ran; after the error
    and its details, so the `error:` line stays the first thing said."""
    command = next((a for a in args if not a.startswith("-")), None)
    text = hint(err, f"trellis {command}" if command else "trellis")
    if text is not None:
        output.print_line(f"hint: {text}", err=True)


def _report_error(message: str) -> None:
    """`error: <message>` on stderr, escaped (messages quote names from the checkpoint); the traceback
    of the exception being handled follows with --debug."""
    output.print_line(f"error: {message}", style="bold red", err=True)
    if output.state.debug:
        output.stderr.print_exception()


__all__ = ["app", "main", "COMMANDS", "EXIT_USAGE"]
if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
