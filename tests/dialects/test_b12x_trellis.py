"""`b12x_trellis` version-2 blocks: detected, validated (each release's parser, the rate tensor's shape, the
nibbles of its codebook), the codebook era named, and where the rates can run. The parsers of b12x 1.5.1 (the
installed one) and 1.3.0 (its own directory, in a subprocess; see test_btx.py) are the oracle of every verdict."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from helpers import run_cli
from test_btx import needs_130, needs_151, oracle, verdict

GLM = {"quant_method": "b12x_trellis", "b12x_trellis": {
    "version": 2, "codebook": "mcg", "rate": {"granularity": "per_expert_projection"},
    "scale": {"input_scales": {"vectors": "per_layer", "gains": "none"},
              "intermediate_scales": {"vectors": "per_expert", "gains": "none"},
              "output_scales": {"vectors": "per_layer", "gains": "none"}},
    "transform": {"projection": {"kind": "scaled_hadamard", "block_size": 128}, "expert": {"kind": "none"}}}}
K3_LUT = {"quant_method": "b12x_trellis", "b12x_trellis": {
    "version": 2, "codebook": "lut_e4m3", "rate": {"granularity": "uniform"},
    "scale": {f: {"vectors": "per_expert", "gains": "none"} for f in
              ("input_scales", "intermediate_scales", "output_scales")},
    "transform": {"projection": {"kind": "scaled_hadamard", "block_size": 128},
                  "expert": {"kind": "intermediate_hadamard", "pre_block_size": 512, "post_block_size": 128,
                             "sign_pattern_granularity": "per_expert"}}}}


def _sqg(quant: dict) -> dict:
    """The same block in b12x 1.3.0's names."""
    q = copy.deepcopy(quant)
    b = q["b12x_trellis"]
    b["codebook"] = b["codebook"].replace("lut_", "sqg_")
    expert = b["transform"]["expert"]
    if expert["kind"] == "intermediate_hadamard":
        expert["kind"] = "coupled_hadamard"
        expert["draw_granularity"] = expert.pop("sign_pattern_granularity")
    return q


def _edit(quant: dict, path: str, value) -> dict:
    q = copy.deepcopy(quant)
    *parents, key = path.split(".")
    node = q
    for part in parents:
        node = node[part]
    if value is DELETE:
        del node[key]
    else:
        node[key] = value
    return q


DELETE = object()
B = "b12x_trellis"
BLOCKS = {
    "glm": GLM, "k3-lut": K3_LUT, "k3-sqg": _sqg(K3_LUT), "glm-grouped": _edit(GLM, f"{B}.rate.group_size", 256),
    "lut-fp16": _edit(GLM, f"{B}.codebook", "lut_fp16"), "sqg-fp16": _edit(GLM, f"{B}.codebook", "sqg_fp16"),
    "extra-wrapper-key": _edit(GLM, "tensor_integrity", {}), "method": _edit(GLM, "quant_method", "exl3"),
    "version-3": _edit(GLM, f"{B}.version", 3), "version-bool": _edit(GLM, f"{B}.version", True),
    "group-48": _edit(GLM, f"{B}.rate.group_size", 48), "group-bool": _edit(GLM, f"{B}.rate.group_size", True),
    "group-null": _edit(GLM, f"{B}.rate.group_size", None),
    "granularity": _edit(GLM, f"{B}.rate.granularity", "per_head"),
    "vectors-none": _edit(GLM, f"{B}.scale.input_scales.vectors", "none"),
    "gains-bad": _edit(GLM, f"{B}.scale.output_scales.gains", "per_token"),
    "no-scale": _edit(GLM, f"{B}.scale", DELETE), "scale-list": _edit(GLM, f"{B}.scale", []),
    "proj-none-block": _edit(GLM, f"{B}.transform.projection", {"kind": "none", "block_size": 128}),
    "proj-none": _edit(GLM, f"{B}.transform.projection", {"kind": "none"}),
    "proj-96": _edit(GLM, f"{B}.transform.projection.block_size", 96),
    "proj-no-block": _edit(GLM, f"{B}.transform.projection", {"kind": "scaled_hadamard"}),
    "proj-kind": _edit(GLM, f"{B}.transform.projection.kind", "hadamard"),
    "expert-none-extra": _edit(GLM, f"{B}.transform.expert", {"kind": "none", "pre_block_size": 512}),
    "expert-pre-384": _edit(K3_LUT, f"{B}.transform.expert.pre_block_size", 384),
    "expert-granularity": _edit(K3_LUT, f"{B}.transform.expert.sign_pattern_granularity", "per_layer"),
    "expert-missing": _edit(K3_LUT, f"{B}.transform.expert.post_block_size", DELETE),
    "unknown-top": _edit(GLM, f"{B}.notes", "x"), "codebook-int": _edit(GLM, f"{B}.codebook", 3),
}


def _trellis_verdicts(quant: dict) -> dict[str, bool]:
    from trellis_cli.dialects.b12x_trellis import rules

    return {era.release: not rules.parse(quant, era).problems for era in rules.ERAS}


@needs_151
@needs_130
def test_each_release_parser_agrees_with_trellis():
    """Every block: trellis passes it under release R exactly when R's own TrellisConfig parser does."""
    names = list(BLOCKS)
    quants = json.dumps([BLOCKS[n] for n in names])
    seen = {"b12x 1.5.1": oracle("1.5.1", "trellis-config", quants), "b12x 1.3.0": oracle("1.3.0", "trellis-config",
                                                                                             quants)}
    for i, name in enumerate(names):
        ours = _trellis_verdicts(BLOCKS[name])
        for release, results in seen.items():
            assert ours[release] == ("ok" in results[i]), (name, release, results[i])
    assert {n for n in names if _trellis_verdicts(BLOCKS[n]) == {"b12x 1.5.1": True, "b12x 1.3.0": False}} == {
        "k3-lut", "lut-fp16"}
    assert {n for n in names if _trellis_verdicts(BLOCKS[n]) == {"b12x 1.5.1": False, "b12x 1.3.0": True}} == {
        "k3-sqg", "sqg-fp16"}


def write(root: Path, quant: dict, rate=None, *, shape=(2, 4, 3), span="3..4") -> Path:
    """A config.json with the block (GLM-like toy geometry: 5 layers, the first 3 dense, 4 experts) and the
    exporter's metadata file holding `rate` (default: 0x33 everywhere; None writes no file)."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    config = {"model_type": "glm_moe_dsa", "hidden_size": 256, "moe_intermediate_size": 512,
              "n_routed_experts": 4, "num_hidden_layers": 5, "first_k_dense_replace": 3, "quantization_config": quant}
    (root / "config.json").write_text(json.dumps(config))
    if rate is not False:
        tensor = torch.full(shape, 0x33, dtype=torch.uint8) if rate is None else rate
        save_file({"b12x_trellis.rate": tensor}, str(root / "b12x-trellis.safetensors"),
                  metadata={"quant_method": "b12x_trellis", "moe_layer_indices": span})
    return root


def validate(capsys, root: Path, *args: str) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, "validate", str(root), "--json", *args)
    return code, json.loads(out)


def codes(doc: dict) -> dict[str, dict]:
    return {f["code"]: f for f in doc["findings"]}


def test_glm_block_loads_on_both_releases(capsys, tmp_path):
    code, doc = validate(capsys, write(tmp_path / "ck", GLM))
    assert code == 0 and doc["context"]["dialect"] == "b12x_trellis-v2"
    assert verdict(doc, "b12x-exl3-v1")["loads"] and verdict(doc, "b12x-1.3.0")["loads"]
    assert not verdict(doc, "exllamav3")["loads"]


@pytest.mark.parametrize("quant, loads_151, era", [(K3_LUT, True, "lut_*"), (_sqg(K3_LUT), False, "sqg_*")])
def test_the_codebook_era_is_named_and_the_other_parser_refuses(capsys, tmp_path, quant, loads_151, era):
    root = write(tmp_path / "ck", quant, shape=(1,))
    code, doc = validate(capsys, root)
    assert f"the {era}" in codes(doc)["b12x_trellis.era"]["message"]
    assert verdict(doc, "b12x-exl3-v1")["loads"] is loads_151 and verdict(doc, "b12x-1.3.0")["loads"] is not loads_151
    refused = verdict(doc, "b12x-1.3.0" if loads_151 else "b12x-exl3-v1")["reasons"][0]
    assert refused["code"] == "engine.b12x-trellis" and refused["location"]["tensor"].endswith(".codebook")
    assert ("b12x 1.3.0" if loads_151 else "b12x 1.5.1") in refused["message"]
    assert code == (0 if loads_151 else 1)  # the default profile is b12x 1.5.x's
    code, doc = validate(capsys, root, "--engine", "b12x-1.3.0")
    assert code == (1 if loads_151 else 0)


def test_a_block_both_parsers_refuse_is_a_format_error_naming_field_and_releases(capsys, tmp_path):
    code, doc = validate(capsys, write(tmp_path / "ck", BLOCKS["group-48"]))
    finding = codes(doc)["b12x_trellis.group-size"]
    assert code == 1 and finding["location"]["tensor"] == "quantization_config.b12x_trellis.rate.group_size"
    assert "b12x 1.5.1 and b12x 1.3.0" in finding["message"] and finding["found"] == "48"


@pytest.mark.parametrize("shape, span, ok", [((2, 4, 3), "3..4", True), ((2, 4), "3..4", False),
                                             ((3, 4, 3), "3..4", False), ((3, 4, 3), "3..5", True)])
def test_rate_tensor_shape(capsys, tmp_path, shape, span, ok):
    code, doc = validate(capsys, write(tmp_path / "ck", GLM, shape=shape, span=span))
    assert ("b12x_trellis.rate-shape" not in codes(doc)) is ok and code == (0 if ok else 1)


def test_grouped_rates_shape_and_the_atom_layout(capsys, tmp_path):
    """group_size 256 over I 512: a trailing axis of 2; the atom layout is selected: sm_103 only, both wheels
    refuse it by name."""
    import torch

    code, doc = validate(capsys, write(tmp_path / "ck", BLOCKS["glm-grouped"], shape=(2, 4, 3, 2)))
    assert "b12x_trellis.rate-shape" not in codes(doc)
    assert "sm_103" in codes(doc)["b12x_trellis.atom-layout"]["message"]
    for engine, release in (("b12x-exl3-v1", "b12x 1.5.1"), ("b12x-1.3.0", "b12x 1.3.0")):
        reason = verdict(doc, engine)["reasons"][0]
        assert reason["code"] == "engine.b12x-trellis-atoms" and release in reason["message"]
    rate = torch.full((2, 4, 3), 0x33, dtype=torch.uint8)
    rate[1, 2, 0] = 0x34  # unequal nibbles
    _, doc = validate(capsys, write(tmp_path / "uneven", GLM, rate))
    assert "unequal nibbles (0x34)" in verdict(doc, "b12x-exl3-v1")["reasons"][0]["message"]
    rate[1, 2, 0] = 0x66  # mcg K6
    _, doc = validate(capsys, write(tmp_path / "k6", GLM, rate))
    assert "mcg K6" in verdict(doc, "b12x-1.3.0")["reasons"][0]["reason"]


@pytest.mark.parametrize("codebook, byte, ok", [("mcg", 0x66, True), ("mcg", 0x77, False), ("mcg", 0x12, False),
                                                ("lut_e4m3", 0x44, True), ("lut_e4m3", 0x55, False),
                                                ("lut_fp16", 0x56, True), ("lut_fp16", 0x44, False)])
def test_nibble_sets_per_codebook(capsys, tmp_path, codebook, byte, ok):
    import torch

    rate = torch.full((2, 4, 3), byte, dtype=torch.uint8)
    _, doc = validate(capsys, write(tmp_path / "ck", _edit(GLM, f"{B}.codebook", codebook), rate))
    assert ("b12x_trellis.rate-nibble" not in codes(doc)) is ok


def test_without_the_rate_tensor_it_says_what_was_not_checked(capsys, tmp_path):
    code, doc = validate(capsys, write(tmp_path / "ck", GLM, rate=False))
    assert code == 0 and codes(doc)["b12x_trellis.rate-missing"]["severity"] == "warning"


def test_inspect_reads_it(capsys, tmp_path):
    root = write(tmp_path / "ck", GLM)
    code, out, err = run_cli(capsys, "inspect", str(root))
    assert code == 0, err
