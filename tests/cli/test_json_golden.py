"""Every `--json` document the CLI prints, pinned key for key against tests/data/json/.

One workspace is built through the CLI itself (synth presets, then every conversion of the table), and each
command's document is compared with its golden file as text, so key order is pinned too. Only what truly
varies from run to run is normalized: absolute paths (the temporary workspace's, in any string), wall-clock
timings and the free space of the disk (`VARYING`), a route pack's manifest hash in diff's declarations (the
manifest records its source's absolute path), and the float results of the CPU smoke check (its sums depend on
the thread count). Set TRELLIS_REGOLD=1 to rewrite the golden files after a change
that is meant to change a document.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from helpers import run_cli
from trellis_cli.sample import sample_path

pytestmark = pytest.mark.slow  # one workspace of every conversion: about half a minute

GOLDEN = Path(__file__).resolve().parent.parent / "data" / "json"
REGOLD = os.environ.get("TRELLIS_REGOLD") == "1"

# Keys whose values are measured, not computed: timings and the disk's free space.
VARYING = {"seconds", "write_seconds", "throughput_mb_s", "free_bytes"}

# A route pack's manifest records its source's absolute path, so the byte counts of such a tree follow the
# path's length: every checkpoint, the bundled samples' copies included, lives under a root of this length.
ROOT_LENGTH = 200

# Small synth checkpoints beyond the presets' defaults: a uniform shared-H TR3 that converts to exl3-v1.
EXL3_READY = ["--hidden", "256", "--intermediate", "512", "--experts", "4", "--tp", "1", "--layers", "3,4",
              "--uniform", "4", "--top-k", "2", "--shared-h"]


def normalized(doc, roots: dict[str, str]):
    """`doc` with every root path in its strings replaced by its placeholder and the VARYING values blanked."""
    if isinstance(doc, dict) and doc.get("key") == "manifest_sha256":
        # diff's structure row of a route pack's manifest hash: the manifest records its source's absolute path
        doc = {k: v if k not in ("a", "b") or v is None else "<varies>" for k, v in doc.items()}
    if isinstance(doc, dict):
        return {k: "<varies>" if k in VARYING else normalized(v, roots) for k, v in doc.items()}
    if isinstance(doc, list):
        return [normalized(v, roots) for v in doc]
    if isinstance(doc, str):
        for root, placeholder in roots.items():
            doc = doc.replace(root, placeholder)
    return doc


def smoke_normalized(doc: dict) -> dict:
    """A CPU smoke document with its float results blanked (their last bits follow the thread count)."""
    for check in doc["checks"]:
        check["value"], check["detail"] = "<float>", "<float>"
    return doc


class Workspace:
    """The documents, by golden name, of one run of the CLI commands over a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.roots = {str(root): "<tmp>"}
        self.docs: dict[str, tuple[int, str]] = {}

    def run(self, name: str, *args: str) -> None:
        """`trellis ARGS...` in process, its stdout captured here (a module fixture has no capsys)."""
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code, _, _ = run_cli(None, *args)  # None: the output stays in the redirected streams
        assert out.getvalue(), f"{name}: no document (exit {code}): {err.getvalue()}"
        doc = normalized(json.loads(out.getvalue()), self.roots)
        if name.startswith("bench-smoke"):
            doc = smoke_normalized(doc)
        self.docs[name] = (code, json.dumps(doc, indent=2) + "\n")

    def path(self, name: str) -> str:
        return str(self.root / name)


def build(ws: Workspace) -> None:
    p = ws.path
    s, sh = p("tr3"), p("tr3-shared-h")
    for variant in ("tr3", "tr3-shared-h"):
        shutil.copytree(sample_path(variant), s if variant == "tr3" else sh)
    ws.run("synth-tiny", "synth", p("tiny"), "--json")
    ws.run("synth-glm53-tiny", "synth", p("glm53"), "--preset", "glm53-tiny", "--json")
    ws.run("synth-exl3-ready", "synth", p("tr3u"), *EXL3_READY, "--json")
    ws.run("synth-exl3-v1", "synth", p("x6"), "--format", "exl3-v1", "--hidden", "256", "--intermediate", "1024",
           "--experts", "6", "--layers", "3,4", "--partition", "5/1", "--top-k", "2", "--json")

    conversions = [  # (name, source, out, --to, extra options)
        ("sample-to-route-pack", s, "rp", "route-pack", []),
        ("sample-to-tr3", s, "tr3same", "tr3", []),
        ("tr3-tp1-to-tr3-tp2", p("tr3u"), "tr3tp2", "tr3", ["--tp", "2"]),
        ("shared-h-to-route-pack-layer3", sh, "rp3", "route-pack", ["--layers", "3", "--shared-h"]),
        ("tr3-to-exl3-v1", p("tr3u"), "x", "exl3-v1", []),
        ("exl3-v1-to-route-pack", p("x"), "xrp", "route-pack", []),
        ("exl3-v1-to-tr3", p("x"), "xtr3", "tr3", []),
        ("exl3-v1-to-btx", p("x"), "btx", "btx", []),
        ("btx-to-exl3-v1", p("btx"), "xback", "exl3-v1", []),
        ("glm53-to-tr3-tp2", p("glm53"), "g2", "tr3", ["--tp", "2"]),
        ("tr3-to-glm53-stream", p("g2"), "gback", "glm53-stream", []),
    ]
    for name, src, out, to, extra in conversions:
        ws.run(f"repack-{name}-plan", "repack", src, p(out), "--to", to, *extra, "--dry-run", "--json")
        ws.run(f"repack-{name}", "repack", src, p(out), "--to", to, *extra, "--json")

    checkpoints = {"sample": s, "shared-h": sh, "tiny": p("tiny"), "glm53": p("glm53"), "route-pack": p("rp"),
                   "tr3-tp2": p("tr3tp2"), "exl3-v1": p("x"), "btx": p("btx"), "exl3-v1-route-pack": p("xrp")}
    for name, path in checkpoints.items():
        ws.run(f"inspect-{name}", "inspect", path, "--json")
        ws.run(f"validate-{name}", "validate", path, "--json")
    for name in ("sample", "route-pack", "exl3-v1", "glm53"):
        ws.run(f"inspect-tensors-{name}", "inspect", checkpoints[name], "--tensors", "--json")
    ws.run("inspect-sample-tp2-h100", "inspect", s, "--tp", "2", "--gpu", "h100", "--ctx", "4096", "--json")
    ws.run("validate-sample-vllm-exl3-190-tp2", "validate", s, "--engine", "vllm-exl3-190", "--tp", "2", "--json")

    ws.run("fit-sample-tp2-h100", "fit", s, "--tp", "2", "--gpu", "h100", "--ctx", "4096", "--json")
    ws.run("fit-tiny-tp1-b200", "fit", p("tiny"), "--tp", "1", "--gpu", "b200", "--ctx", "auto", "--json")
    ws.run("fit-exl3-v1-tp1", "fit", p("x"), "--tp", "1", "--gpu", "h200", "--ctx", "2048", "--json")

    ws.run("diff-sample-shared-h-layer3", "diff", s, sh, "--layers", "3", "--json")
    ws.run("diff-sample-route-pack", "diff", s, p("rp"), "--json")
    ws.run("diff-tr3-exl3-v1", "diff", p("tr3u"), p("x"), "--layers", "3", "--json")
    ws.run("diff-sample-itself", "diff", s, s, "--json")

    ws.run("bench-plan-synthetic", "bench", "--synthetic", "glm52-tp4", "--plan", "--arch", "sm_90", "--json")
    ws.run("bench-plan-sample", "bench", s, "--plan", "--arch", "sm_120", "--m", "1,64", "--json")
    ws.run("bench-plan-route-pack", "bench", p("rp"), "--plan", "--arch", "sm_100", "--layer", "4", "--rank", "1",
           "--json")
    ws.run("bench-smoke-cpu-tp2", "bench", s, "--tp", "2", "--device", "cpu", "--smoke", "--json")


GOLDEN_NAMES = sorted(p.stem for p in GOLDEN.glob("*.json"))


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> dict[str, tuple[int, str]]:
    base = tmp_path_factory.mktemp("golden")
    assert len(str(base)) < ROOT_LENGTH - 10, f"the temporary directory's path is too long: {base}"
    root = base / ("w" * (ROOT_LENGTH - len(str(base)) - 1))
    root.mkdir()
    ws = Workspace(root)
    # bench --plan says whether a kernel's registers come from ptxas's record of a library built on this machine
    # or from the launch bounds: an empty kernel cache makes it the launch bounds wherever the test runs (CI has
    # built the kernels into $TRELLIS_KERNEL_CACHE before the tests).
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRELLIS_KERNEL_CACHE", str(base / "kernel-cache"))
        build(ws)
    return ws.docs


def test_golden_files_and_documents_name_the_same_runs(documents):
    if REGOLD:
        GOLDEN.mkdir(parents=True, exist_ok=True)
        for name, (code, text) in documents.items():
            (GOLDEN / f"{name}.json").write_text(text)
            (GOLDEN / f"{name}.json").with_suffix(".exit").write_text(f"{code}\n")
    assert sorted(documents) == sorted(p.stem for p in GOLDEN.glob("*.json"))


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_document_is_unchanged(documents, name):
    code, text = documents[name]
    assert text == (GOLDEN / f"{name}.json").read_text(), name
    assert code == int((GOLDEN / f"{name}.exit").read_text())
