"""Loader-exact verdicts: each class a loader refuses fails `trellis validate` by default with a named finding,
`--engine` picks the profile that is enforced, and every report carries each profile's verdict.

Each fixture is a `tiny` synth checkpoint (tp 2, 8 experts, layers 3-4, mcg) with one edit, run through the
real CLI in-process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from corrupt import SHARD3, SHARD4, edit_json, key, rebuild_shard, write_tensor_bytes
from helpers import tiny_checkpoint as synth, to_plain_exl3, to_r7, to_r7_v2
from trellis_cli.sources import HEADER_WINDOW
from trellis_cli.cli import validate_cmd
from trellis_cli.validate.engines import BY_NAME, ENGINES
from helpers import run_cli


def run(argv, capsys) -> tuple[int, str, str]:
    return run_cli(capsys, *argv)


def report(root, capsys, *extra) -> tuple[int, dict]:
    code, out, err = run(["validate", str(root), "--json", *extra], capsys)
    assert "Traceback" not in out + err
    return code, json.loads(out)


def error_codes(doc: dict) -> dict[str, str | None]:
    return {f["code"]: f.get("engine") for f in doc["findings"] if f["severity"] == "error"}


def verdicts(doc: dict) -> dict[str, bool]:
    return {v["name"]: v["loads"] for v in doc["engines"]}


def hybrid(root: Path, **changes) -> Path:
    def mutate(config: dict) -> None:
        for name, value in changes.items():
            if value is None:
                config["hybrid_tr3_tail"].pop(name, None)
            else:
                config["hybrid_tr3_tail"][name] = value

    edit_json(root / "config.json", mutate)
    return root


# ---- the classes the newest loader refuses, each failing the default verdict ----------------------------

def test_legacy_sign_vectors_on_routed_experts(tmp_path, capsys):
    root = synth(tmp_path)

    def to_legacy(tensors: dict) -> None:
        suh = tensors.pop(key(3, 2, "gate_proj", 1, "suh"))
        tensors[key(3, 2, "gate_proj", 1, "su")] = torch.zeros(suh.numel() // 16, dtype=torch.int16)

    rebuild_shard(root, SHARD3, to_legacy)
    for extra in ((), ("--deep",)):
        code, doc = report(root, capsys, *extra)
        assert code == 1 and error_codes(doc).get("engine.legacy-signs") == "vllm-exl3-shared-h"
    assert not verdicts(doc)["vllm-exl3-190"]  # both fork versions register suh/svh only for experts


def test_three_bitrates_in_one_layer(tmp_path, capsys):
    bitmap = {3: (3, 4, 5, 3, 4, 5, 3, 4), 4: (3, 4, 5, 5, 4, 3, 3, 4)}
    root = synth(tmp_path, partition=None, bitmap=bitmap)
    code, doc = report(root, capsys)
    assert code == 1 and error_codes(doc).get("engine.tier-count") == "vllm-exl3-shared-h"
    code, doc = report(root, capsys, "--engine", "vllm-exl3-190")  # no serial fallback in the older one either
    assert code == 1 and "engine.tier-count" in error_codes(doc)
    assert "tier.count" not in {f["code"] for f in doc["findings"]}


@pytest.mark.parametrize("bits", ["mixed_k34_per_tensor", "MIXED-K34", "k3"])
def test_bits_spelled_other_than_an_integer_or_mixed(tmp_path, capsys, bits):
    code, doc = report(hybrid(synth(tmp_path), bits=bits), capsys)
    assert code == 1 and "config.tr3-bits" in error_codes(doc)
    assert not any(verdicts(doc).values())


def test_bits_mixed_in_another_case_is_the_newer_loaders_refusal(tmp_path, capsys):
    root = hybrid(synth(tmp_path), bits="Mixed")
    code, doc = report(root, capsys)
    assert code == 1 and error_codes(doc) == {"engine.bits": "vllm-exl3-shared-h"}
    code, doc = report(root, capsys, "--engine", "vllm-exl3-190")  # compares case-insensitively
    assert code == 0 and not verdicts(doc)["vllm-exl3-shared-h"] and verdicts(doc)["vllm-exl3-190"]


def test_uniform_without_a_per_layer_map(tmp_path, capsys):
    root = hybrid(synth(tmp_path, partition=None, uniform_k=3), trellis_bits_by_layer=None, tr3_tail_per_layer=None,
                  nvfp4_keep_per_layer=None)
    code, doc = report(root, capsys)
    assert code == 1 and error_codes(doc) == {"engine.bits-map": "vllm-exl3-shared-h"}
    code, doc = report(root, capsys, "--engine", "vllm-exl3-190")  # reads bits for every layer
    assert code == 0


def test_uniform_with_the_legacy_pair_derives_the_map(tmp_path, capsys):
    root = hybrid(synth(tmp_path, partition=None, uniform_k=3), trellis_bits_by_layer=None)
    code, doc = report(root, capsys)
    assert code == 0 and all(verdicts(doc)[name] for name in ("vllm-exl3-shared-h", "vllm-exl3-190"))


@pytest.mark.parametrize("k", [7, 2])
def test_uniform_bits_no_loader_serves(tmp_path, capsys, k):
    root = hybrid(synth(tmp_path, partition=None, uniform_k=3), trellis_bits_by_layer=None, bits=k)
    code, doc = report(root, capsys)
    assert code == 1 and "config.tr3-bits" in error_codes(doc)


def test_wrong_marker_value_is_read_by_default(tmp_path, capsys):
    root = synth(tmp_path)
    write_tensor_bytes(root / SHARD4, key(4, 5, "down_proj", 0, "mcg"), (12345).to_bytes(4, "little"))
    code, doc = report(root, capsys)
    assert code == 1 and "marker.value" in error_codes(doc)
    assert doc["context"]["markers"] == "read" and doc["checked"]["markers read"] == 2 * 8 * 3 * 2


def test_k_values_and_unused_k_are_drift_between_the_versions(tmp_path, capsys):
    root = hybrid(synth(tmp_path), k_values=[3, 4, 5])  # layers use K3 and K4 only
    code, doc = report(root, capsys)
    assert code == 1 and {"engine.k-values", "engine.unused-k"} <= set(error_codes(doc))
    assert all(engine == "vllm-exl3-shared-h" for engine in error_codes(doc).values())
    code, doc = report(root, capsys, "--engine", "vllm-exl3-190")  # any subset of 3..6, unused K allowed
    assert code == 0 and not verdicts(doc)["vllm-exl3-shared-h"]


def test_mtp_layer_with_only_tail_tr3(tmp_path, capsys):
    root = synth(tmp_path, num_hidden_layers=4, mtp_layers=1)  # layer 4 is the MTP head

    def mtp_overlay(bitmap: dict) -> None:
        bitmap["4"].pop("k")  # only the all-trellis tail list is left

    edit_json(root / "tier_bitmap.json", mtp_overlay)
    code, doc = report(root, capsys, "--layers", "4")
    assert "runtime.mtp-layer" in {f["code"] for f in doc["findings"] if f["severity"] == "info"}
    assert code == 1 and "engine.bitmap-field" in error_codes(doc)


@pytest.mark.slow
def test_remote_source_says_its_markers_were_not_read(tmp_path):
    import os
    import subprocess
    import sys

    from hub_server import HubServer

    served = synth(tmp_path, "served")
    write_tensor_bytes(served / SHARD4, key(4, 5, "down_proj", 0, "mcg"), (12345).to_bytes(4, "little"))
    with HubServer() as hub:
        hub.add_commit("org/tiny", served)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "home"),
                   HF_HUB_DISABLE_PROGRESS_BARS="1")

        def validate(*extra):
            return subprocess.run([sys.executable, "-m", "trellis_cli", "validate", "org/tiny", *extra], env=env,
                                  capture_output=True, text=True, timeout=120)

        plain = validate()
        assert plain.returncode == 0, plain.stderr
        assert "info[marker.not-read]" in plain.stdout
        assert plain.stdout.strip().splitlines()[-1].startswith("loads on (codebook markers not read): ")
        assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0  # nothing downloaded for it
        deep = validate("--deep", "--layers", "4", "--json")
        assert deep.returncode == 1 and "marker.value" in error_codes(json.loads(deep.stdout))


# ---- runtime traps -------------------------------------------------------------------------------------

def test_r7_metadata_boots_eager(tmp_path, capsys):
    code, doc = report(to_r7_v2(synth(tmp_path, tp=1)), capsys)
    eager = [f for f in doc["findings"] if f["code"] == "runtime.eager"]
    assert code == 0 and eager and eager[0]["severity"] == "warning" and "eager" in eager[0]["message"]
    assert doc["context"]["engine"] == "vllm-exl3-r7"  # the R7 dialect's default: the one profile that reads it
    assert [name for name, loads in verdicts(doc).items() if loads] == ["vllm-exl3-r7"]
    assert run(["validate", str(tmp_path / "ckpt"), "--strict"], capsys)[0] == 1


def test_incomplete_r7_metadata_is_the_r7_loaders_refusal(tmp_path, capsys):
    code, doc = report(to_r7(synth(tmp_path)), capsys)  # no schema, codebook or moe_layers; rank-sliced names
    assert code == 1 and doc["context"]["engine"] == "vllm-exl3-r7"
    assert {"engine.r7-schema", "engine.r7-bits", "engine.r7-layers"} <= set(error_codes(doc))


def test_embedded_quantization_config_disagreeing_with_the_file(tmp_path, capsys):
    root = synth(tmp_path)
    (root / "quantization_config.json").write_text(json.dumps({"quant_method": "exl3", "bits": 4.0,
                                                               "codebook": "mcg"}))
    code, doc = report(root, capsys)
    drift = [f for f in doc["findings"] if f["code"] == "config.quant-config-drift"]
    assert code == 0 and drift and "takes the embedded one" in drift[0]["message"]


def test_scale_tensor_no_loader_applies(tmp_path, capsys):
    root = synth(tmp_path)
    rebuild_shard(root, SHARD3, lambda t: t.update({key(3, 0, "up_proj", 0, "scale"): torch.ones(1).half()}))
    code, doc = report(root, capsys)
    scale = [f for f in doc["findings"] if f["code"] == "tensor.scale-ignored"]
    assert scale and scale[0]["severity"] == "warning" and "no loader applies it" in scale[0]["message"]


# ---- each profile's verdict on valid checkpoints --------------------------------------------------------

@pytest.mark.parametrize("changes,expected", [
    ({"rotation_layout": "shared_h_v1"},
     {"vllm-exl3-shared-h": None, "vllm-exl3-190": "shared_h_v1 unsupported", "vllm-exl3-r7": None,
      "vllm-exl3-manifest": "wrong container", "b12x-exl3-v1": "wrong container",
      "b12x-1.3.0": "wrong container", "exllamav3": "rank-sliced names"}),
    ({"partition": None, "uniform_k": 3},
     {"vllm-exl3-shared-h": None, "vllm-exl3-190": None, "vllm-exl3-r7": None,
      "vllm-exl3-manifest": "wrong container", "b12x-exl3-v1": "wrong container",
      "b12x-1.3.0": "wrong container", "exllamav3": "rank-sliced names"}),
    ({"partition": None, "uniform_k": 8},
     {"vllm-exl3-shared-h": None, "vllm-exl3-190": "uniform K8 unsupported",
      "vllm-exl3-r7": "uniform K8 unsupported", "vllm-exl3-manifest": "wrong container",
      "b12x-exl3-v1": "wrong container", "b12x-1.3.0": "wrong container", "exllamav3": "rank-sliced names"}),
], ids=["shared-h", "uniform-k3", "uniform-k8"])
def test_profile_verdicts_on_valid_checkpoints(tmp_path, capsys, changes, expected):
    root = synth(tmp_path, **changes)
    code, doc = report(root, capsys)
    assert code == 0 and doc["ok"] and doc["context"]["engine"] == "vllm-exl3-shared-h"
    got = {v["name"]: (None if v["loads"] else v["reasons"][0]["reason"]) for v in doc["engines"]}
    assert got == expected
    for name, reason in expected.items():  # each profile, enforced, agrees with its own verdict
        code, doc = report(root, capsys, "--engine", name)
        assert code == (0 if reason is None else 1)
        assert [v["name"] for v in doc["engines"] if v["enforced"]] == [name]
        assert reason is None or all(engine == name for engine in error_codes(doc).values())


def test_plain_exl3_defaults_to_exllamav3(tmp_path, capsys):
    root = to_plain_exl3(synth(tmp_path, tp=1, partition=None, uniform_k=4))
    code, doc = report(root, capsys)
    assert code == 0 and doc["context"]["engine"] == "exllamav3" and verdicts(doc)["exllamav3"]
    assert not verdicts(doc)["vllm-exl3-shared-h"]  # its tensor_storage records have no stored_tensors
    assert "runtime.eager" in {f["code"] for f in doc["findings"]}


def test_human_report_ends_with_the_compatibility_line(tmp_path, capsys):
    root = synth(tmp_path, rotation_layout="shared_h_v1")
    code, out, _ = run(["validate", str(root)], capsys)
    assert code == 0 and out.strip().splitlines()[-1] == (
        "loads on: vllm-exl3 (shared-H rules) ✓ TP 2 · vllm-exl3 (#190 rules) ✗ shared_h_v1 unsupported · "
        "vllm-exl3 (R7 rules) ✓ TP 2 · vllm-exl3 (manifest rules) ✗ wrong container · "
        "b12x exl3-v1 ✗ wrong container · b12x 1.3.0 ✗ wrong container · exllamav3 ✗ rank-sliced names")
    code, out, _ = run(["validate", str(root), "--engine", "vllm-exl3-190"], capsys)
    assert code == 1 and "error[engine.shared-h] (vllm-exl3-190)" in out
    assert "engine rules enforced: vllm-exl3-190 (--engine)" in out


def test_unknown_engine_is_a_usage_error_listing_the_names(tmp_path, capsys):
    code, out, err = run(["validate", str(synth(tmp_path)), "--engine", "vllm"], capsys)
    assert code == 2 and out == ""
    assert all(name in err for name in BY_NAME)


def test_help_lists_every_engine():
    assert [e.name for e in ENGINES] == [n.strip() for n in validate_cmd.ENGINE_HELP.split(":")[1].split("(")[0]
                                         .split(",")]
