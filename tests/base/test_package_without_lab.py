"""The package works without the lab: a copy of trellis_cli/ (kernels included, as the wheel ships them) and
nothing else imports every module, validates the bundled sample and plans a layer; nothing in the package
names the lab."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trellis_cli"


def test_no_module_of_the_package_imports_the_lab():
    offenders = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+lab\b", p.read_text(encoding="utf-8"), re.M)]
    assert not offenders


def test_the_wheel_holds_no_lab():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    find = text[text.index("[tool.setuptools.packages.find]"):]
    assert re.search(r'^include = \["trellis_cli\*"\]$', find, re.M)


@pytest.mark.slow
def test_package_runs_with_lab_deleted(tmp_path: Path):
    site = tmp_path / "site"
    shutil.copytree(PACKAGE, site / "trellis_cli", symlinks=False,  # kernels/ copied, as the wheel has it
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site), "NO_COLOR": "1"}
    env.pop("TRELLIS_PLAN_LIMITS", None)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)

    imported = run("-c", """
import importlib, pkgutil, sys
import trellis_cli
assert trellis_cli.__file__.startswith(sys.argv[1]), trellis_cli.__file__
names = [m.name for m in pkgutil.walk_packages(trellis_cli.__path__, "trellis_cli.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
assert not [m for m in sys.modules if m == "lab" or m.startswith("lab.")]
print(len(names))
""", str(site))
    assert imported.returncode == 0, imported.stderr
    assert int(imported.stdout) > 50
    validated = run("-m", "trellis_cli", "validate")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    planned = run("-m", "trellis_cli", "bench", "--plan", "--arch", "sm_120", "--synthetic", "glm52-tp4")
    assert planned.returncode == 0 and "M=3072: packed, 128-row tiles on mma128" in planned.stdout, planned.stderr
