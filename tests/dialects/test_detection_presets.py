"""Detection never mistakes one layout for another: every synth preset in every form trellis can name (TR3,
exl3-v1, its BTX spelling, a b12x_trellis v2 block over the same model), each detected as itself.

The forms are built from each preset's own metadata documents (config.json, the manifest), which is all
detection reads, so the production presets cost no disk; the tiny preset is also written and opened whole."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from helpers import run_cli
from test_b12x_trellis import GLM
from trellis_cli import synth
from trellis_cli.dialects import registry
from trellis_cli.dialects.btx import names
from trellis_cli.dialects.interface import Probe
from trellis_cli.errors import UnknownDialect


def _exl3v1_manifest(spec) -> dict:
    from trellis_cli.dialects.exl3v1.synth import manifest_for
    from trellis_cli.dialects.exl3v1.write import layer_file_name, manifest_document
    from trellis_cli.dialects.exl3v1.schema import LayerEntry

    m = manifest_for(spec)
    m.layers = {li: LayerEntry(layer_file_name(li), "0" * 64) for li in m.layer_indices}
    return manifest_document(m)


def _b12x_trellis_config(spec) -> dict:
    config = copy.deepcopy(synth.config_json(spec))
    config.pop("hybrid_tr3_tail")
    config["quantization_config"] = GLM
    return config


def forms(spec) -> dict[str, dict[str, Any]]:
    """form name -> {file name: JSON document (or None for a data file)}."""
    config = synth.config_json(spec)
    manifest = _exl3v1_manifest(spec)
    btx = names.manifest_as_btx(manifest)
    btx["layers"] = {k: {"file": names.layer_file_as_btx(v["file"]), "sha256": v["sha256"]}
                     for k, v in btx["layers"].items()}
    return {
        "tr3": {"config.json": config, "model-layer-003.safetensors": None},
        "exl3-v1": {"exl3-manifest.json": manifest, **{e["file"]: None for e in manifest["layers"].values()}},
        "btx": {"btx-manifest.json": btx, **{e["file"]: None for e in btx["layers"].values()}},
        "b12x_trellis": {"config.json": _b12x_trellis_config(spec), "b12x-trellis.safetensors": None},
        "exl3-v1 beside a BTX manifest": {"exl3-manifest.json": manifest, "btx-manifest.json": btx},
        "exl3-v1 with a b12x_trellis config": {"exl3-manifest.json": manifest,
                                               "config.json": _b12x_trellis_config(spec)},
    }


EXPECTED = {"tr3": {"tr3/per_expert_v1", "tr3/shared_h_v1"}, "exl3-v1": {"exl3-v1"}, "btx": {"btx-atoms-v1"},
            "b12x_trellis": {"b12x_trellis-v2"}, "exl3-v1 beside a BTX manifest": {"exl3-v1"},
            "exl3-v1 with a b12x_trellis config": {"exl3-v1"}}


def detect(files: dict[str, Any]) -> str:
    config = files.get("config.json")
    probe = Probe({name: 1 for name in files}, config, None, lambda name: copy.deepcopy(files[name]))
    return registry.detect(probe).dialect


@pytest.mark.parametrize("preset", list(synth.PRESETS))
def test_every_preset_in_every_form_is_detected_as_itself(preset):
    spec = synth.preset(preset)
    for form, files in forms(spec).items():
        assert detect(files) in EXPECTED[form], (preset, form)


@pytest.mark.parametrize("preset", list(synth.PRESETS))
def test_metadata_of_one_form_never_claims_another(preset):
    """Each form's identity strings swapped into the other form's file: refused by name or not claimed, never
    read as the wrong layout."""
    spec = synth.preset(preset)
    manifest = _exl3v1_manifest(spec)
    for doc, name in ((manifest, "btx-manifest.json"), (names.manifest_as_btx(manifest), "exl3-manifest.json")):
        try:
            got = detect({name: doc, "config.json": synth.config_json(spec)})
        except UnknownDialect:
            continue
        assert got.startswith("tr3/"), (preset, name)  # only the config.json beside it claims the directory


def test_tiny_preset_written_in_every_form_opens_as_itself(capsys, tmp_path):
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint

    spec = synth.preset("tiny")
    tr3 = synth.write_checkpoint(tmp_path / "tr3", spec)
    exl3 = write_exl3v1_checkpoint(tmp_path / "exl3", spec)
    code, out, err = run_cli(capsys, "repack", str(exl3), str(tmp_path / "btx"), "--to", "btx")
    assert code == 0, err
    b12x = Path(tmp_path / "b12x")
    b12x.mkdir()
    (b12x / "config.json").write_text(json.dumps(_b12x_trellis_config(spec)))
    got = {name: open_checkpoint(root).dialect for name, root in (("tr3", tr3), ("exl3-v1", exl3),
                                                                    ("btx", tmp_path / "btx"), ("b12x_trellis", b12x))}
    assert all(got[name] in EXPECTED[name] for name in got), got
