"""Every path of this repository that the docs name exists: a file or folder written in backticks or linked, in
README.md, docs/ (the dated perf log aside: it records what was true then) and lab/.

A backticked path counts as the project's when its first folder is one of the repository's top-level folders or a
package of trellis_cli (`dialects/tr3/write.py` is read under trellis_cli/); other paths name files of the
engines and peers (`vllm/v1/worker/gpu_worker.py`) or of a user's output (`OUT/manifest.json`) and are not checked
here. A path is also read beside the page that names it (lab/README.md names `kernel/lab.py`). A segment in capitals (`NAME`, `OUT`) is a placeholder."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trellis_cli"

_BACKTICKED = re.compile(r"`([A-Za-z0-9_.\-]+/[A-Za-z0-9_.\-/]*)`")
_LINK = re.compile(r"\]\(([^)#\s]+)")
_PATH_SUFFIX = re.compile(r"(\.(py|md|cu|cuh|h|sh|toml|json|txt|patch|safetensors)|/)$")


def _tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    names = set(out.split())
    for name in list(names):
        names.update(str(parent) for parent in PurePosixPath(name).parents if str(parent) != ".")
    return names


def _pages() -> list[Path]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "lab").rglob("*.md"))]
    return [p for p in pages if "perf-log" not in p.relative_to(ROOT).parts]


def _project_roots() -> tuple[set[str], set[str]]:
    top = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")} | {".ci"}
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")}
    return top, packages


def test_every_project_path_the_docs_name_exists():
    tracked = _tracked()
    top, packages = _project_roots()
    missing: dict[str, set[str]] = {}
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        where = str(page.relative_to(ROOT))
        for match in _BACKTICKED.finditer(text):
            path = match.group(1).rstrip("/")
            if not _PATH_SUFFIX.search(match.group(1)) or any(part.isupper() for part in path.split("/")):
                continue
            first = path.split("/", 1)[0]
            beside = str(page.parent.relative_to(ROOT) / path) if page.parent != ROOT else path
            if beside in tracked:
                continue
            if first in top:
                candidate = path
            elif first in packages:
                candidate = f"trellis_cli/{path}"
            else:
                continue
            if candidate not in tracked:
                missing.setdefault(path, set()).add(where)
        for match in _LINK.finditer(text):
            target = match.group(1)
            if "://" in target:
                continue
            resolved = (page.parent / target).resolve()
            if not resolved.exists():
                missing.setdefault(target, set()).add(where)
    assert not missing, {k: sorted(v) for k, v in sorted(missing.items())}
