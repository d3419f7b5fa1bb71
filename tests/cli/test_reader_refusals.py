"""Every command reads checkpoint bytes through one reader (checkpoint/reader.py), hardened as validate's opening:
a damaged file is named with its finding code and exit 1 by fit, diff and inspect --tensors, as validate names it,
never an answer computed from the files that could be read. And the library refuses arguments that make no
sense with its own error type.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from corrupt import READER_CORPUS, SHARD4
from helpers import run_cli, tiny_checkpoint
from trellis_cli.errors import UsageError

DAMAGED_FILES = (SHARD4, "model-extra.safetensors")
COMMANDS = {
    "fit": ("fit", "{src}", "--tp", "2", "--gpu", "h100"),
    "fit --json": ("fit", "{src}", "--tp", "2", "--gpu", "h100", "--json"),
    "diff A B": ("diff", "{good}", "{src}"),
    "diff B A": ("diff", "{src}", "{good}"),
    "inspect --tensors": ("inspect", "{src}", "--tensors"),
    "inspect --tensors --json": ("inspect", "{src}", "--tensors", "--json"),
}


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    root = tiny_checkpoint(tmp_path_factory.mktemp("reader"), "good")
    (root / "MANIFEST.sha256").unlink()
    return root


@pytest.fixture(scope="module")
def damaged(good, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    base = tmp_path_factory.mktemp("damaged")
    out = {}
    for name, damage in READER_CORPUS.items():
        root = Path(shutil.copytree(good, base / name, symlinks=True))
        out[name] = (root, damage(root))
    return out


def _validate_codes(capsys, root: Path) -> set[str]:
    code, stdout, _ = run_cli(capsys, "validate", str(root), "--json")
    assert code == 1
    return {f["code"] for f in json.loads(stdout)["findings"]}


@pytest.mark.parametrize("case", list(READER_CORPUS))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_damaged_file_is_named_with_exit_1(capsys, good, damaged, case, command):
    root, finding = damaged[case]
    args = [a.format(src=root, good=good) for a in COMMANDS[command]]
    code, stdout, err = run_cli(capsys, *args)
    assert code == 1, (stdout[-400:], err[-400:])
    assert "Traceback" not in err and "internal error" not in err
    line = err.strip().splitlines()[-1]
    assert f"[{finding}]" in line and any(name in line for name in DAMAGED_FILES), line
    assert "fits" not in stdout and "identical" not in stdout and '"tensors"' not in stdout


@pytest.mark.parametrize("case", list(READER_CORPUS))
def test_validate_names_the_same_fault(capsys, damaged, case):
    root, finding = damaged[case]
    assert finding in _validate_codes(capsys, root)


def test_a_file_rewritten_after_the_listing_is_a_named_error(capsys, good, tmp_path, monkeypatch):
    """A shard that grows between the listing and its header read (a download or a converter still writing):
    its header and its bytes may be of two versions, so the read is refused by name, not taken as absent."""
    from trellis_cli.sources import LocalSource

    root = Path(shutil.copytree(good, tmp_path / "src"))
    listed = LocalSource.list_files

    def list_then_append(self):
        files = listed(self)
        if self.root == root:
            with open(root / SHARD4, "ab") as f:  # the writer goes on after the directory was listed
                f.write(b"\0" * 4096)
        return files

    monkeypatch.setattr(LocalSource, "list_files", list_then_append)
    code, stdout, err = run_cli(capsys, "fit", str(root), "--tp", "2", "--gpu", "h100")
    assert code == 1 and "[file.changed]" in err and SHARD4 in err and "fits" not in stdout


def test_an_intact_checkpoint_still_answers(capsys, good):
    assert run_cli(capsys, "fit", str(good), "--tp", "2", "--gpu", "h100")[0] == 0
    assert run_cli(capsys, "diff", str(good), str(good))[0] == 0
    code, stdout, _ = run_cli(capsys, "inspect", str(good), "--tensors", "--json")
    assert code == 0 and len(json.loads(stdout)["tensors"]) == 384 + 92  # the experts, the other weights


# ---- the library's arguments ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [0, -1, 2.5, True, "2"])
def test_a_tp_that_is_not_a_positive_integer_is_a_usage_error(good, tp):
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.inspect_request import InspectRequest
    from trellis_cli.validate import run_validation
    from trellis_cli.validate.request import ValidateRequest

    with pytest.raises(UsageError, match="tp must be an integer of at least 1"):
        InspectRequest(tp=tp)
    with pytest.raises(UsageError, match="tp must be an integer of at least 1"):
        ValidateRequest(tp=tp)
    with pytest.raises(UsageError, match="tp must be an integer of at least 1"):
        run_validation(open_checkpoint(good), tp=tp)


@pytest.mark.parametrize("total", [0, -5, 1.5])
def test_a_gpu_without_memory_is_a_usage_error(total):
    from trellis_cli.fit.gpus import Gpu
    from trellis_cli.inspect_request import InspectRequest

    with pytest.raises(UsageError, match="total_bytes an integer of at least 1"):
        InspectRequest(tp=2, gpu=Gpu("card", "a card", total))


@pytest.mark.parametrize("source", [None, 3, object()])
def test_a_source_that_is_not_one_is_a_usage_error(source):
    from trellis_cli.inspect_request import inspect_source
    from trellis_cli.validate.request import validate_source

    for call in (inspect_source, validate_source):
        with pytest.raises(UsageError, match="must be a Source"):
            call(source)


def test_library_and_cli_agree_on_a_good_request(capsys, good):
    from trellis_cli.inspect_request import InspectRequest, inspect_source

    document = inspect_source(good, InspectRequest(tp=2))
    code, stdout, _ = run_cli(capsys, "inspect", str(good), "--tp", "2", "--json")
    assert code == 0 and json.loads(stdout)["serve_tp"] == document.to_json()["serve_tp"]
