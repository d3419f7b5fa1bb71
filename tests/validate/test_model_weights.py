"""Every engine profile checks the weights its model class loads besides the routed experts (issue: an
experts-only checkpoint passed as loadable). Real synth checkpoints, the real CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from corrupt import edit_json
from helpers import exl3v1_specs, run_cli, serve_exl3v1, tiny_checkpoint, to_plain_exl3, write_tensors
from trellis_cli.checkpoint.architecture import model_weights
from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
from trellis_cli.synth import NON_EXPERT_SHARD, preset, write_checkpoint


def _validate(capsys, root: Path, *args: str) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, "validate", str(root), "--json", *args)
    return code, json.loads(out)


def _experts_only_tr3(t: Path) -> Path:
    return tiny_checkpoint(t, "tr3", non_expert="none")


def _experts_only_exl3v1(t: Path) -> Path:
    root = serve_exl3v1(write_exl3v1_checkpoint(t / "x", exl3v1_specs()["uniform-shared"]))
    (root / "model-non-expert.safetensors").unlink()
    return root


def _experts_only_plain(t: Path) -> Path:
    return to_plain_exl3(tiny_checkpoint(t, "plain", tp=1, non_expert="none"))


# Each profile on a container it reads (a container it does not read is refused before its weights are looked at).
PROFILES = {"vllm-exl3-shared-h": _experts_only_tr3, "vllm-exl3-190": _experts_only_tr3,
            "vllm-exl3-r7": _experts_only_tr3, "vllm-exl3-manifest": _experts_only_exl3v1,
            "b12x-exl3-v1": _experts_only_exl3v1, "exllamav3": _experts_only_plain}


@pytest.mark.parametrize("engine", PROFILES)
def test_experts_only_fails_every_profile_naming_the_missing_weights(engine, tmp_path, capsys):
    root = PROFILES[engine](tmp_path)
    code, doc = _validate(capsys, root, "--engine", engine)
    missing = [f for f in doc["findings"] if f["code"] == "engine.weights-missing"]
    verdict = next(v for v in doc["engines"] if v["name"] == engine)
    assert code == 1 and not verdict["loads"] and len(missing) == 1 and missing[0]["engine"] == engine
    assert "engine.weights-missing" in [r["code"] for r in verdict["reasons"]]
    message = missing[0]["message"]
    for name in ("lm_head.weight", "model.embed_tokens.weight", "self_attn.kv_a_proj_with_mqa.weight",
                 "mlp.gate.weight", "self_attn.indexer.wk.weight"):
        assert name in message, (name, message)


def test_every_weight_passes_and_the_cli_names_what_is_missing(tmp_path, capsys):
    whole = tiny_checkpoint(tmp_path, "whole")  # the tiny preset writes every weight
    code, out, _ = run_cli(capsys, "validate", str(whole), "--tp", "2")
    assert code == 0 and "vllm-exl3 (shared-H rules) ✓" in out.splitlines()[-1]
    code, out, _ = run_cli(capsys, "validate", str(_experts_only_tr3(tmp_path)), "--tp", "2")
    assert code == 1 and "error[engine.weights-missing] (vllm-exl3-shared-h)" in out
    assert "model weights missing" in out.splitlines()[-1] and "written by `trellis synth` without --non-expert" in out


def test_a_weight_of_the_wrong_shape_is_named(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path)
    config = json.loads((root / "config.json").read_text())
    weights = {w.name: w for w in model_weights(config).main}
    from safetensors.torch import load_file

    tensors = load_file(str(root / NON_EXPERT_SHARD))
    name = "model.layers.3.self_attn.o_proj.weight"
    tensors[name] = torch.ones(weights[name].shape[0], weights[name].shape[1] * 2, dtype=torch.bfloat16)
    write_tensors(root / NON_EXPERT_SHARD, tensors)
    (root / "MANIFEST.sha256").unlink()
    code, doc = _validate(capsys, root)
    shape = [f for f in doc["findings"] if f["code"] == "engine.weights-shape"]
    assert code == 1 and len(shape) == 1 and shape[0]["location"]["tensor"] == name
    assert str(list(weights[name].shape)) in shape[0]["message"]


def test_an_unquantized_weight_stored_as_exl3_is_refused(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(str(root / NON_EXPERT_SHARD))
    del tensors["model.layers.3.mlp.gate.weight"]  # the router: GateLinear is allocated unquantized
    tensors["model.layers.3.mlp.gate.trellis"] = torch.zeros(16, 1, 48, dtype=torch.int16)
    write_tensors(root / NON_EXPERT_SHARD, tensors)
    edit_json(root / "model.safetensors.index.json", lambda d: d["weight_map"].update(
        {"model.layers.3.mlp.gate.trellis": NON_EXPERT_SHARD}))
    (root / "MANIFEST.sha256").unlink()
    code, doc = _validate(capsys, root)
    assert code == 1 and [f["location"].get("tensor") for f in doc["findings"]
                          if f["code"] == "engine.weights-missing"] == ["model.layers.3.mlp.gate.weight"]


def test_thousands_missing_are_one_summary_per_engine(tmp_path, capsys):
    spec = replace(preset("glm52-tp4"), layers=(3,), sparse=True, experts=16, partition=(12, 4))
    root = write_checkpoint(tmp_path / "glm", spec)
    code, doc = _validate(capsys, root, "--tp", "4")
    missing = [f for f in doc["findings"] if f["code"] == "engine.weights-missing"]
    message = missing[0]["message"]
    assert code == 1 and len(missing) == 1 and message.startswith("1,479 of the 1,479 weights")
    assert "model.layers.{0-77}.self_attn.q_a_proj.weight" in message and "lm_head.weight" in message
    assert "more kinds" not in message and len(message) < 3000


def test_the_mtp_layer_is_a_warning_of_its_own(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path, num_hidden_layers=4, mtp_layers=1)  # layer 4 is the MTP layer
    from safetensors.torch import load_file

    tensors = load_file(str(root / NON_EXPERT_SHARD))
    for name in [n for n in tensors if n.startswith("model.layers.4.") and "self_attn" in n]:
        del tensors[name]
    write_tensors(root / NON_EXPERT_SHARD, tensors)
    edit_json(root / "model.safetensors.index.json",
              lambda d: d.update(weight_map={k: v for k, v in d["weight_map"].items() if k in tensors
                                             or v != NON_EXPERT_SHARD}))
    (root / "MANIFEST.sha256").unlink()
    code, doc = _validate(capsys, root)
    codes = {f["code"]: f["severity"] for f in doc["findings"]}
    assert code == 0 and codes.get("weights.mtp-missing") == "warning", codes


def test_an_architecture_not_listed_is_said_not_passed_silently(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path, non_expert="none", model=None)
    code, doc = _validate(capsys, root)
    assert code == 0 and [(f["code"], f["severity"]) for f in doc["findings"]] == [("weights.unchecked", "info")]


def test_synth_help_says_what_the_presets_make(capsys):
    code, out, _ = run_cli(capsys, "synth", "--help")
    text = " ".join(out.split())
    assert code == 0 and "glm52-tp4 writes the routed experts only" in text and "--non-expert" in text
