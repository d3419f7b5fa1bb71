"""The per-shard header scans of a local checkpoint (`reader.scan_shards`: fit's columns, the route-pack dry run's
names; `reader.each_scanned`: the full opening's header columns) run in forked worker processes on a large
checkpoint: the same results, in the same order, with the same progress, and through the CLI the same answer or the
same refusal of a damaged shard as in one process. Each way is forced on a small real checkpoint through
`reader.PARALLEL_SHARDS`.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import struct
import sys
import threading
import time
from pathlib import Path

import pytest

from corrupt import READER_CORPUS, rewrite_header
from helpers import run_cli, tiny_checkpoint
from trellis_cli.checkpoint import reader
from trellis_cli.dialects.open import open_checkpoint
from trellis_cli.errors import CheckFailed
from trellis_cli.sources import LocalSource

FORKED, HERE = 2, 10**9  # reader.PARALLEL_SHARDS: every scan of two shards or more forked; none


@pytest.fixture
def forked(monkeypatch):
    """The scans forked from here on; skipped where no fork is safe (one usable core, another thread running)."""
    monkeypatch.setattr(reader, "PARALLEL_SHARDS", FORKED)
    deadline = time.monotonic() + 1
    for thread in threading.enumerate():  # an earlier test's thread on its way out (a loopback server's handler)
        if thread is not threading.current_thread():
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if reader._scan_workers(FORKED) == 1:
        threads = [f"{thread.name} ({type(thread).__module__}.{type(thread).__qualname__})"
                   for thread in threading.enumerate()]
        pytest.skip(f"no worker process here: one usable core, or another thread runs ({threads})")


def each_way(monkeypatch, compute):
    """[compute() with the scans forked, compute() with them in this process]."""
    out = []
    for threshold in (FORKED, HERE):
        monkeypatch.setattr(reader, "PARALLEL_SHARDS", threshold)
        out.append(compute())
    return out


# ---- the helper --------------------------------------------------------------------------------------------------

NAMES = [f"shard-{i:02}" for i in range(40)]


def gone(pids):
    """Whether none of `pids` is a process any more (every worker exited and was reaped)."""
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def test_the_shards_are_scanned_in_workers_and_taken_in_order(forked):
    progress = []
    found = reader.scan_shards(NAMES, lambda name: (name, os.getpid()), progress.append)
    assert found is not None and [name for name, _ in found] == NAMES and progress == list(range(1, 41))
    pids = {pid for _, pid in found}
    assert os.getpid() not in pids and multiprocessing.active_children() == [] and gone(pids)


def test_the_first_shard_without_a_result_decides(forked):
    progress = []
    assert reader.scan_shards(NAMES, lambda name: None if name in ("shard-07", "shard-30") else name,
                              progress.append) is None
    assert progress == list(range(1, 8)) and multiprocessing.active_children() == []


def test_an_exception_comes_back_with_its_code(monkeypatch, forked):
    def scan(name):
        if name == "shard-11":
            raise CheckFailed(f"{name}: refused", code="file.header")
        return name

    for threshold in (FORKED, HERE):
        monkeypatch.setattr(reader, "PARALLEL_SHARDS", threshold)
        with pytest.raises(CheckFailed, match="shard-11: refused") as caught:
            reader.scan_shards(NAMES, scan, lambda _done: None)
        assert caught.value.code == "file.header" and multiprocessing.active_children() == []



def test_a_slow_taker_keeps_the_workers_a_few_chunks_ahead(forked, tmp_path):
    """Results the workers finish before they are taken wait in this process: at most two chunks a worker are
    given out ahead of the one being taken, so a slow taker does not hold every shard's result at once."""
    log = tmp_path / "scanned"

    def scan(name):
        with open(log, "a") as f:
            f.write(name + "\n")
        return name

    seen = []

    def take(name, _result):
        if not seen:
            time.sleep(0.5)  # (every worker done with what it was given by now)
            seen.append(len(log.read_text().split()))
        return True

    workers = reader._scan_workers(len(NAMES))
    chunk = len(NAMES) // (4 * workers)
    assert reader.each_scanned(NAMES, scan, take)
    assert seen[0] <= (2 * workers + 1) * chunk < len(NAMES)
    assert sorted(log.read_text().split()) == NAMES  # (each once)

def test_a_lost_worker_leaves_the_rest_to_this_process(forked):
    """A worker killed mid-scan (by the OOM killer, say): the shards not yet taken are scanned here, none twice."""
    parent = os.getpid()

    def scan(name):
        if name == "shard-25" and os.getpid() != parent:
            os._exit(1)
        return name

    progress = []
    assert reader.scan_shards(NAMES, scan, progress.append) == NAMES and progress == list(range(1, 41))
    assert multiprocessing.active_children() == []


def test_a_worker_writes_nothing_and_leaves_ctrl_c_to_this_process(forked, capfd):
    """Whatever a worker would print goes nowhere; a Ctrl-C it receives (the terminal sends it to every process of
    the group) is ignored there: this process alone answers it."""
    parent = os.getpid()

    def scan(name):
        if os.getpid() != parent:
            print(f"{name} from a worker")
            print(f"{name} from a worker", file=sys.stderr)
            os.kill(os.getpid(), signal.SIGINT)
        return name

    assert reader.scan_shards(NAMES, scan, lambda _done: None) == NAMES
    assert capfd.readouterr() == ("", "")


# ---- a real checkpoint ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """Four layers of experts and the other weights: five shards."""
    root = tiny_checkpoint(tmp_path_factory.mktemp("workers"), "good", layers=(3, 4, 5, 6), non_expert="bf16")
    (root / "MANIFEST.sha256").unlink()
    return root


def test_the_columns_are_the_same_either_way(monkeypatch, forked, good):
    source = LocalSource(good)
    files = reader.listing(source)

    def columns():
        progress = []
        found = reader.shard_columns(source, files, lambda *args: progress.append(args))
        assert found is not None
        return found, progress

    (forked_found, forked_progress), (here, here_progress) = each_way(monkeypatch, columns)
    assert list(forked_found.linears.items()) == list(here.linears.items()) and len(here.linears) == 4
    assert list(forked_found.others.items()) == list(here.others.items()) and len(here.others) == 1
    assert forked_progress == here_progress == [("files", done, 5) for done in range(6)]


def test_the_header_names_are_the_same_either_way(monkeypatch, forked, good):
    source = LocalSource(good)
    files = reader.listing(source)
    forked_names, here = each_way(monkeypatch, lambda: reader.every_header_names(source, files))
    assert here is not None and list(forked_names.items()) == list(here.items()) and len(here) == 5


def answers(monkeypatch, capsys, root: Path, out: Path):
    """[(exit code, stdout, stderr) of fit --json, of repack --dry-run --json] with the scans forked, then here."""
    def run():
        fit = run_cli(capsys, "fit", str(root), "--tp", "2", "--gpu", "h100", "--json")
        code, stdout, err = run_cli(capsys, "repack", str(root), str(out), "--dry-run", "--json")
        if code == 0:
            plan = json.loads(stdout)
            plan.pop("free_bytes")  # the filesystem moves between two runs
            stdout = json.dumps(plan)
        return [fit, (code, stdout, err)]
    return each_way(monkeypatch, run)


def test_the_cli_answers_the_same_either_way(monkeypatch, capsys, forked, good, tmp_path):
    (fit, dry_run), here = answers(monkeypatch, capsys, good, tmp_path / "pack")
    assert [fit, dry_run] == here and fit[0] == 0 and dry_run[0] == 0
    assert not any(tmp_path.iterdir())


def renamed_expert(root: Path) -> str:
    """A shard the quick scans do not prove (another spelling of an expert's name): the full opening answers."""
    def rename(header):
        name = next(n for n in header if ".experts.0.gate_proj.rank0." in n)
        header[name.replace("experts.0.", "experts.00.")] = header.pop(name)
    rewrite_header(root / "model-layer-005.safetensors", rename)
    return ""


DAMAGE = {**READER_CORPUS, "expert-name-spelled-otherwise": renamed_expert}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_middle_shard_is_refused_the_same_either_way(monkeypatch, capsys, forked, good, tmp_path, case):
    """Each damage hits a shard between the first and the last (model-layer-004 or -005 of five); the same exit
    code and the same words, the finding named by its code."""
    root = Path(shutil.copytree(good, tmp_path / case, symlinks=True))
    finding = DAMAGE[case](root)
    (fit, dry_run), here = answers(monkeypatch, capsys, root, tmp_path / "pack")
    assert [fit, dry_run] == here
    if finding:
        assert fit[0] == 1 and f"[{finding}]" in fit[2] and "Traceback" not in fit[2] + dry_run[2]
    assert not (tmp_path / "pack").exists()


# ---- the full opening ----------------------------------------------------------------------------------------

def opened(root: Path):
    """What the opening of `root` built, as plain values: every header (its records in stored order), the tensors
    in their order, the MoE layers (their linears' records, the names split in the workers), the findings in their
    order, the progress reported, and how many distinct objects hold the offsets (shards laid out alike share them:
    `header_layout.shared_offsets`)."""
    progress = []
    ckpt = open_checkpoint(root, progress=lambda *args: progress.append(args))
    headers = [(file, h.header_len, h.file_size, h.metadata, list(h.tensors.items()))
               for file, h in ckpt.headers.items()]
    layers = [(li, [(e, [(p, list(ranks.items())) for p, ranks in projs.items()]) for e, projs in moe.experts.items()],
               sorted(moe.files), moe.rank_sliced, list(moe.unparsed)) for li, moe in ckpt.layers.items()]
    offsets = {id(offset) for h in ckpt.headers.values() for t in h.tensors.values() for offset in (t.begin, t.end)}
    return headers, list(ckpt.tensors.items()), layers, ckpt.parse_findings, progress, len(offsets)


def test_the_opening_is_the_same_either_way(monkeypatch, forked, good):
    forked_opening, here = each_way(monkeypatch, lambda: opened(good))
    assert forked_opening == here and len(here[0]) == 5 and len(here[2]) == 4 and not here[3]
    assert [args for args in here[4] if args[0] == "files"] == [("files", done, 5) for done in range(6)]


def edit_raw_header(path: Path, edit) -> None:
    """Edit a shard's header bytes in place, keeping its length (space padding)."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        body = edit(f.read(n).rstrip(b" "))
        assert len(body) <= n
        f.seek(8)
        f.write(body + b" " * (n - len(body)))


def name_twice(root: Path) -> str:
    """Two entries of one name (expert 2's key spelled as expert 1's): the strict parser's refusal."""
    def edit(raw):
        name = next(n for n in json.loads(raw) if ".experts.1." in n).encode()
        return raw.replace(b'"%s":' % name.replace(b".experts.1.", b".experts.2."), b'"%s":' % name, 1)
    edit_raw_header(root / "model-layer-004.safetensors", edit)
    return "file.header"


def reversed_pair(root: Path) -> str:
    def reverse(header):
        name = next(n for n, e in header.items() if n != "__metadata__" and e["data_offsets"][0] < e["data_offsets"][1])
        header[name]["data_offsets"].reverse()
    rewrite_header(root / "model-layer-005.safetensors", reverse)
    return "file.header"


def other_layout(root: Path) -> str:
    """A valid header in another layout than safetensors' own (one entry's fields in another order): parsed in full."""
    def reorder(header):
        name = next(n for n in header if n != "__metadata__")
        header[name] = {"shape": header[name]["shape"], **header[name]}
    rewrite_header(root / "model-layer-004.safetensors", reorder)
    return ""


def not_utf8_name(root: Path) -> str:
    edit_raw_header(root / "model-layer-005.safetensors", lambda raw: raw.replace(b".experts.1.", b".experts.\xff.", 1))
    return "file.header"


OPENING_DAMAGE = {**DAMAGE, "name-twice": name_twice, "reversed-pair": reversed_pair,
                  "other-layout": other_layout, "name-not-utf8": not_utf8_name}


@pytest.mark.parametrize("case", list(OPENING_DAMAGE))
def test_a_damaged_middle_shard_opens_the_same_either_way(monkeypatch, capsys, forked, good, tmp_path, case):
    """The opening goes on past a shard the workers refuse: that shard is read again and parsed strictly here, so the
    checkpoint, its findings (their words, codes and order) and validate's document are the same as in one process."""
    root = Path(shutil.copytree(good, tmp_path / case, symlinks=True))
    finding = OPENING_DAMAGE[case](root)
    forked_opening, here = each_way(monkeypatch, lambda: opened(root))
    assert forked_opening == here
    forked_validate, validate = each_way(monkeypatch, lambda: run_cli(capsys, "validate", str(root), "--json"))
    assert forked_validate == validate and "Traceback" not in validate[2]
    if finding:
        assert validate[0] == 1 and f'"{finding}"' in validate[1]
