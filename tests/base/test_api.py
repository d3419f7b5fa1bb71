"""The library API in trellis_cli/__init__: every name resolves, and `import trellis_cli` stays light."""

from __future__ import annotations

import os
import subprocess
import sys

import trellis_cli
from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.findings import Report


def test_import_loads_no_other_module_and_no_torch():
    code = ("import sys, trellis_cli; "
            "print(sorted(m for m in sys.modules if m.startswith('trellis_cli') or m == 'torch'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ),
                          check=True)
    assert done.stdout.strip() == "['trellis_cli']"


def test_every_public_name_resolves_to_its_definition():
    for name in trellis_cli.__all__:
        value = getattr(trellis_cli, name)
        if name != "__version__":
            assert getattr(value, "__name__", name) == name, name
    assert set(trellis_cli.__all__) <= set(dir(trellis_cli))


def test_validate_the_bundled_sample_through_the_api():
    checkpoint = trellis_cli.open_checkpoint(trellis_cli.open_source(None))
    assert isinstance(checkpoint, Checkpoint)
    report = trellis_cli.run_validation(checkpoint)
    assert isinstance(report, Report) and report.ok


def test_unknown_name_is_an_attribute_error():
    try:
        trellis_cli.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("no AttributeError")
