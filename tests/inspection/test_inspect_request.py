"""`inspect_source`: the library call behind `trellis inspect`, one opening for every section, the same
document as the CLI's --json."""

from __future__ import annotations

import json

import pytest

import trellis_cli
from helpers import run_cli
from trellis_cli.cli import output
from trellis_cli.dialects import open as dialect_open
from trellis_cli.errors import UsageError
from trellis_cli.fit.gpus import preset as gpu_preset
from trellis_cli.inspect_request import InspectDocument, InspectProgress, InspectRequest, inspect_source
from trellis_cli.synth import preset, write_checkpoint


@pytest.fixture(autouse=True)
def _fresh_flags(monkeypatch):
    monkeypatch.setattr(output.state, "debug", False)
    monkeypatch.setattr(output.state, "quiet", False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("inspect-request") / "tiny", preset("tiny"))


def test_every_section_from_one_opening_and_the_cli_json_is_the_document(tiny, capsys, monkeypatch):
    real, opened = dialect_open.open_checkpoint, []

    def counting(source, **kwargs):  # the real opener, counted
        opened.append(source)
        return real(source, **kwargs)

    monkeypatch.setattr(dialect_open, "open_checkpoint", counting)
    stages: list[str] = []
    logged: list[str] = []
    request = InspectRequest(layers=[3], tp=2, gpu=gpu_preset("h100"), ctx=4096)
    document = inspect_source(str(tiny), request, InspectProgress(stage=lambda s, d, t: stages.append(s),
                                                                  log=logged.append))
    assert len(opened) == 1 and stages and logged == [f"reading headers of {tiny} ..."]
    assert isinstance(document, InspectDocument) and document.tensors is None and document.unreadable == []
    assert document.summary is not None and [row["layer"] for row in document.summary["layers"]] == [3]
    assert document.serve_tp is not None and document.serve_tp["tp"] == 2 and document.serve_tp["engines"]
    assert document.fit is not None and document.fit.request.tp == 2 and document.fit.ctx == 4096
    code, out, err = run_cli(capsys, "inspect", str(tiny), "--layers", "3", "--tp", "2", "--gpu", "h100",
                             "--ctx", "4096", "--json")
    assert code == 0, err
    assert json.loads(out) == json.loads(json.dumps(document.to_json()))
    assert list(json.loads(out)) == [*document.summary, "serve_tp", "fit"]  # the sections after the summary


def test_the_tensor_listing_is_its_own_document(tiny, capsys):
    document = trellis_cli.inspect_source(str(tiny), trellis_cli.InspectRequest(tensors=True, layers=[3]))
    assert document.summary is None and document.serve_tp is None and document.fit is None
    assert document.tensors is not None
    # the rows are made from the headers as they are read (bounded memory); the document holds them as a list
    assert document.to_json() == {**document.tensors, "tensors": list(document.tensors["tensors"])}
    code, out, _ = run_cli(capsys, "inspect", str(tiny), "--tensors", "--layers", "3", "--json")
    assert code == 0 and json.loads(out) == json.loads(json.dumps(document.to_json()))


@pytest.mark.parametrize("fields", [{"gpu": gpu_preset("rtx-pro-6000")}, {"ctx": 4096},
                                    {"tp": 2, "ctx": 4096}])
def test_a_fit_section_needs_tp_and_a_gpu_when_the_request_is_made(fields):
    with pytest.raises(UsageError, match="needs --tp N and --gpu NAME or --gpu-mem SIZE"):
        InspectRequest(**fields)


def test_a_missing_layer_is_a_usage_error(tiny):
    with pytest.raises(UsageError, match=r"--layers: \[99\] not in the source"):
        inspect_source(str(tiny), InspectRequest(layers=[99]))
