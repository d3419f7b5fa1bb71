"""The commands are module-level functions registered from one table (cli/app.py COMMANDS): each can be
imported and called without the app, and the app is exactly the table."""

from __future__ import annotations

import importlib
import json

import pytest

from helpers import run_cli
from trellis_cli.cli import app as app_module
from trellis_cli.cli.app import COMMANDS, build_command
from trellis_cli.cli.bench_cmd import bench_command
from trellis_cli.cli.diff_cmd import diff_command
from trellis_cli.cli.fit_cmd import fit_command
from trellis_cli.cli.inspect_cmd import inspect_command
from trellis_cli.cli.repack_cmd import repack_command
from trellis_cli.cli.synth_cmd import synth_command
from trellis_cli.cli.validate_cmd import validate_command
from trellis_cli.errors import UsageError

FUNCTIONS = {"inspect": inspect_command, "validate": validate_command, "repack": repack_command,
             "bench": bench_command, "synth": synth_command, "diff": diff_command, "fit": fit_command}


def test_the_table_names_every_command_once_in_help_order():
    assert [name for name, _, _ in COMMANDS] == ["inspect", "validate", "repack", "bench", "synth", "diff", "fit"]
    assert {name: function for name, function, _ in COMMANDS} == FUNCTIONS


@pytest.mark.parametrize("name, function, help_text", COMMANDS)
def test_each_command_is_a_module_level_function_of_its_module(name, function, help_text):
    module = importlib.import_module(f"trellis_cli.cli.{name}_cmd")
    assert function.__qualname__ == function.__name__ == f"{name}_command"  # not a closure (no <locals>)
    assert getattr(module, function.__name__) is function and function.__module__ == module.__name__
    assert help_text and help_text == module.HELP


@pytest.mark.parametrize("name, function, help_text", COMMANDS)
def test_the_app_registers_the_table(name, function, help_text):
    command = build_command().commands[name]  # type: ignore[attr-defined]
    assert command.help == help_text
    registered = {info.name: info.callback for info in app_module.app.registered_commands}
    assert registered[name] is function


def test_a_command_function_runs_when_called_directly(capsys):
    # The Annotated defaults are plain values: the function is callable as written, here on the bundled sample.
    validate_command(as_json=True)
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is True and document["context"]["dialect"].startswith("tr3")
    with pytest.raises(UsageError, match="SOURCE is required"):
        fit_command(tp=4)


def test_help_through_the_app_is_unchanged_by_the_table(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and all(name in out for name, _, _ in COMMANDS)


def test_validate_help_names_every_dialect_default_engine_and_every_engine():
    from trellis_cli.cli.validate_cmd import ENGINE_HELP, HELP
    from trellis_cli.dialects.registry import DIALECTS
    from trellis_cli.validate.engines import ENGINES

    text = " ".join(HELP.split())
    for dialect in DIALECTS:
        assert dialect.default_engine is None or dialect.default_engine in text or dialect.default_engine == \
            "vllm-exl3-shared-h", dialect.name  # TR3's is said as "the newest rank-sliced vLLM loader"
    assert "none)" in text  # the route pack: no engine loads it
    assert [e.name for e in ENGINES] == ENGINE_HELP.split(": ", 1)[1].split(" (default")[0].split(", ")
