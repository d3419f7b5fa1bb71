"""`trellis fit` and `trellis diff` open their checkpoints in the library (fit_source, diff_sources): the CLI
does no checkpoint work, and the library call gives what the command shows."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli
from trellis_cli.dialects import open_checkpoint
from trellis_cli.diff.run import diff_sources, run_diff
from trellis_cli.errors import UsageError
from trellis_cli.fit.gpus import PRESETS
from trellis_cli.fit.run import FitRequest, fit, fit_source
from trellis_cli.sample import sample_path
from trellis_cli.sources import open_source


def test_fit_source_is_fit_on_the_opened_checkpoint(capsys):
    request = FitRequest(tp=2, gpu=PRESETS["h100"], ctx=1024)
    result = fit_source(open_source(None), request)
    assert result.to_json() == fit(open_checkpoint(open_source(None)), request).to_json()
    assert result.dialect == open_checkpoint(open_source(None)).dialect
    code, out, _ = run_cli(capsys, "fit", str(sample_path()), "--tp", "2", "--gpu", "h100", "--ctx", "1024", "--json")
    document = json.loads(out)
    document.pop("source")
    assert code in (0, 1, 5) and document == json.loads(json.dumps(result.to_json()))


def test_fit_source_refuses_a_bad_request_before_opening(tmp_path):
    request = FitRequest(tp=2, gpu=PRESETS["h100"], ctx=1024, dcp=0)
    with pytest.raises(UsageError):  # not SourceUnavailable: nothing was opened
        fit_source(tmp_path / "missing", request)


def test_diff_sources_opens_both_sides_and_says_so(capsys):
    said: list[str] = []
    stages: set[str] = set()
    result = diff_sources(open_source(None), sample_path(), on_open=said.append,
                          open_progress=lambda stage, _done, _total: stages.add(stage))
    assert result.identical and len(said) == 2 and stages
    direct = run_diff(open_checkpoint(open_source(None)), open_checkpoint(sample_path()))
    assert result.to_dict()["methods"] == direct.to_dict()["methods"]
    code, out, _ = run_cli(capsys, "diff", str(sample_path()), str(sample_path()), "--json")
    assert code == 0 and json.loads(out)["identical"] is True
