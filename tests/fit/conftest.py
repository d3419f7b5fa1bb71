"""The production-shape checkpoint of the fit tests, built once per test session."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trellis_cli.synth import preset, write_checkpoint


@pytest.fixture(scope="session")
def glm52_tp4_sparse(tmp_path_factory) -> Path:
    """`synth --preset glm52-tp4 --sparse`: real headers over holes, ~300 GB apparent, a few hundred MB on disk."""
    return write_checkpoint(tmp_path_factory.mktemp("glm52") / "glm",
                            dataclasses.replace(preset("glm52-tp4"), sparse=True))
