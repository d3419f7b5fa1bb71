"""The GLM-5.3-Flash unsliced stream (scope glm53_routed_experts_only): synth, detection against every other
synth preset, inspect, validate (format rules and the fork's loader verdicts at --tp N), fit's named refusal,
diff, and repack to TR3 rank slices and back bit for bit (onward to a route pack and exl3-v1 through TR3).

The tiny variant (H 256, I 512, 8 experts, MoE layers 3..5) is small enough for every fast test; the loader's
exact architecture gate passes only the production geometry, so the verdicts that load are checked on the
sparse glm53-flash preset (slow).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from corrupt import edit_json, rebuild_shard
from helpers import run_cli, tiny_checkpoint, to_plain_exl3, to_r7
from trellis_cli.sources import HEADER_WINDOW
from trellis_cli.dialects import open_checkpoint
from trellis_cli.dialects.glm53.contract import DIALECT_GLM53, SCOPE

LAYER3 = "model-00002-of-00004.safetensors"  # the tiny stream's shard of MoE layer 3
NON_ROUTED = "model-00001-of-00004.safetensors"
VR7 = "the fork's exl3.py with r7_routed_experts (r7-complete-v2-checkpoint-v1) and the GLM-5.3 scope"


def synth_stream(capsys, out: Path, *args: str) -> Path:
    code, _, err = run_cli(capsys, "synth", str(out), "--preset", "glm53-tiny", *args)
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def stream(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("glm53") / "stream"
    code, _, _ = run_cli(None, "synth", str(out), "--preset", "glm53-tiny")
    assert code == 0
    return out


def copy(src: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def validate(capsys, root: Path, *args: str) -> tuple[int, dict]:
    code, out, _ = run_cli(capsys, "validate", str(root), "--json", *args)
    return code, json.loads(out)


def codes(doc: dict, engine: bool | None = None) -> set[str]:
    return {f["code"] for f in doc["findings"] if f["severity"] == "error"
            and (engine is None or (f.get("engine") is not None) == engine)}


def same_tree(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# ---- 1. synth ---------------------------------------------------------------------------------------------

def test_synth_writes_the_release_layout(stream):
    config = json.loads((stream / "config.json").read_text())
    assert config["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "glm5_next_text"
    block = config["quantization_config"]
    assert block == json.loads((stream / "quantization_config.json").read_text())
    assert block["scope"] == SCOPE and block["bits"] == 4 and block["codebook"] == "mcg"
    assert block["non_routed_dtype_policy"] == "official_source_native"
    tensors = load_file(str(stream / LAYER3))
    name = "model.language_model.layers.3.mlp.experts.5.{}.{}"
    assert tensors[name.format("gate_proj", "trellis")].shape == (16, 32, 64)  # [H/16, I/16, 16K]
    assert tensors[name.format("down_proj", "trellis")].shape == (32, 16, 64)  # [I/16, H/16, 16K]
    assert tensors[name.format("gate_proj", "suh")].shape == (256,) and tensors[name.format("gate_proj", "svh")].shape == (512,)
    assert tensors[name.format("up_proj", "mcg")].dtype == torch.int32
    assert int(tensors[name.format("up_proj", "mcg")]) & 0xFFFFFFFF == 0xCBAC1FED
    assert not any(".rank" in n for n in tensors)
    assert tensors[name.format("gate_proj", "suh")].abs().min() > 0  # random data, never zeros


def test_synth_refuses_options_the_stream_has_no_use_for(capsys, tmp_path):
    code, _, err = run_cli(capsys, "synth", str(tmp_path / "x"), "--preset", "glm53-tiny", "--tp", "4")
    assert code == 2 and "--tp" in err and not (tmp_path / "x").exists()


def test_synth_uniform_sets_the_release_k(capsys, tmp_path):
    root = synth_stream(capsys, tmp_path / "k6", "--uniform", "6")
    assert json.loads((root / "config.json").read_text())["quantization_config"]["bits"] == 6
    assert load_file(str(root / LAYER3))["model.language_model.layers.3.mlp.experts.0.up_proj.trellis"].shape[-1] == 96


# ---- 2. detection, inspect, validate ---------------------------------------------------------------------

def _every_other_layout(tmp_path: Path) -> dict[str, Path]:
    from dataclasses import replace

    from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
    from trellis_cli.synth import PRESETS, write_checkpoint

    out = {}
    for name, spec in PRESETS.items():  # every TR3 synth preset (one sparse layer of the production one)
        small = replace(spec, layers=(3,), num_hidden_layers=None, sparse=True) if spec.experts > 64 else spec
        out[f"tr3:{name}"] = write_checkpoint(tmp_path / f"tr3-{name}", small)
        out[f"tr3-shared-h:{name}"] = write_checkpoint(tmp_path / f"sh-{name}",
                                                       replace(small, rotation_layout="shared_h_v1"))
    out["exl3-v1:tiny"] = write_exl3v1_checkpoint(tmp_path / "v1", replace(PRESETS["tiny"], tp=1))
    out["exl3"] = to_plain_exl3(tiny_checkpoint(tmp_path, "plain", tp=1))
    out["r7"] = to_r7(tiny_checkpoint(tmp_path, "r7"))
    return out


def test_detection_never_mistakes_another_preset_for_the_stream(capsys, tmp_path, stream):
    others = _every_other_layout(tmp_path)
    for label, root in others.items():
        assert open_checkpoint(root).dialect != DIALECT_GLM53, label
    for preset in ("glm53-tiny",):
        assert open_checkpoint(stream).dialect == DIALECT_GLM53, preset
    k2 = synth_stream(capsys, tmp_path / "k2", "--uniform", "2")
    assert open_checkpoint(k2).dialect == DIALECT_GLM53
    # Its TR3 form is TR3 (the scope leaves its quantization block), not the stream.
    code, _, err = run_cli(capsys, "repack", str(stream), str(tmp_path / "tr3"), "--to", "tr3")
    assert code == 0, err
    assert open_checkpoint(tmp_path / "tr3").dialect == "tr3/per_expert_v1"


def test_the_scope_in_quantization_config_json_alone_is_still_the_stream(capsys, tmp_path, stream):
    root = copy(stream, tmp_path)
    edit_json(root / "config.json", lambda c: c["quantization_config"].pop("scope"))
    assert open_checkpoint(root).dialect == DIALECT_GLM53
    _, doc = validate(capsys, root)  # but the loader reads the scope from config.json only: named
    assert "engine.glm53-external" in codes(doc, engine=True)


def test_inspect_names_the_layout(capsys, stream):
    code, out, _ = run_cli(capsys, "inspect", str(stream), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["dialect"] == DIALECT_GLM53
    code, out, _ = run_cli(capsys, "inspect", str(stream))
    assert code == 0 and "glm53/unsliced_tp_stream" in out and "K4: 0-7" in out and "layers 3-5" in out
    assert "scope=glm53_routed_experts_only" in out and "bits=4" in out


def test_inspect_tensors_lists_every_tensor_with_its_k(capsys, stream):
    code, out, _ = run_cli(capsys, "inspect", str(stream), "--tensors", "--json")
    assert code == 0
    doc = json.loads(out)
    rows = doc["tensors"] if isinstance(doc, dict) and "tensors" in doc else doc
    rows = rows if isinstance(rows, list) else rows["rows"]
    names = {r["name"]: r for r in rows}
    index = json.loads((stream / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(names) == set(index)
    assert names["model.language_model.layers.4.mlp.experts.2.down_proj.trellis"]["k"] == 4


def test_validate_passes_the_format_and_names_every_loader_refusal(capsys, stream):
    code, doc = validate(capsys, stream)
    assert code == 1 and doc["context"]["dialect"] == DIALECT_GLM53
    assert not codes(doc, engine=False)  # the format rules pass
    # The R7-era loader gates on GLM-5.3-Flash's exact geometry: the tiny variant is refused by field.
    assert codes(doc, engine=True) == {"engine.glm53-architecture", "engine.glm53-experts", "engine.glm53-layers"}
    for f in doc["findings"]:
        if f.get("engine"):
            assert f["engine"] == "vllm-exl3-r7" and (f["location"].get("tensor") or f["location"].get("layer"))
    arch = next(f for f in doc["findings"] if f["code"] == "engine.glm53-architecture"
                and "linear_attn" not in f["location"]["tensor"])
    assert arch["location"]["tensor"] == "text_config.num_hidden_layers"
    verdict = {v["name"]: v for v in doc["engines"]}
    assert verdict["vllm-exl3-r7"]["reads"] == VR7 and not verdict["vllm-exl3-r7"]["loads"]
    assert verdict["vllm-exl3-shared-h"]["reasons"][0]["code"] == "engine.container"
    assert verdict["exllamav3"]["reasons"][0]["reason"] == "not profiled"
    assert "vllm-exl3-pr766" in verdict


@pytest.mark.parametrize("corrupt, code", [
    ("drop", "glm53.tensor-missing"), ("k", "glm53.k"), ("rank", "glm53.rank-name"),
    ("marker", "glm53.marker"), ("dtype", "glm53.dtype"), ("layer", "glm53.layer-missing"),
    ("expert", "glm53.expert-missing"), ("codebook", "glm53.codebook")])
def test_every_format_rule_names_its_finding(capsys, tmp_path, stream, corrupt, code):
    root = copy(stream, tmp_path)
    name = "model.language_model.layers.3.mlp.experts.5.up_proj.{}"

    def mutate(t: dict) -> None:
        if corrupt == "drop":
            del t[name.format("svh")]
        elif corrupt == "rank":
            t["model.language_model.layers.3.mlp.experts.5.up_proj.rank0.svh"] = t[name.format("svh")].clone()
        elif corrupt == "marker":
            t[name.format("mcg")] = torch.tensor(7, dtype=torch.int32)
        elif corrupt == "dtype":
            t[name.format("svh")] = t[name.format("svh")].float()
        elif corrupt == "expert":
            for key in [k for k in t if ".experts.7." in k]:
                del t[key]

    if corrupt == "k":
        edit_json(root / "config.json", lambda c: c["quantization_config"].update(bits=6))
    elif corrupt == "layer":
        (root / "model-00004-of-00004.safetensors").unlink()
        edit_json(root / "model.safetensors.index.json", lambda i: i.update(weight_map={
            k: v for k, v in i["weight_map"].items() if v != "model-00004-of-00004.safetensors"}))
    elif corrupt == "codebook":
        edit_json(root / "config.json", lambda c: c["quantization_config"].update(codebook="mul1"))
    else:
        rebuild_shard(root, LAYER3, mutate)
    _, doc = validate(capsys, root)
    assert code in codes(doc, engine=False), codes(doc)
    finding = next(f for f in doc["findings"] if f["code"] == code)
    assert finding["location"].get("tensor") or finding["location"].get("layer") is not None


# ---- 3. engine verdicts at --tp N ------------------------------------------------------------------------

def _tp_refusal(doc: dict, engine: str) -> dict | None:
    verdict = next(v for v in doc["engines"] if v["name"] == engine)
    return next((r for r in verdict["reasons"] if r["code"] == "engine.tp"), None)


@pytest.mark.parametrize("tp, r7, pr766", [(1, True, False), (2, False, False), (4, True, False), (8, True, True),
                                            (3, True, True)])
def test_tp_contracts_of_the_r7_version_and_pr766(capsys, stream, tp, r7, pr766):
    _, doc = validate(capsys, stream, "--tp", str(tp))
    r7_refusal, pr766_refusal = _tp_refusal(doc, "vllm-exl3-r7"), _tp_refusal(doc, "vllm-exl3-pr766")
    assert (r7_refusal is not None) == r7 and (pr766_refusal is not None) == pr766
    if r7_refusal:
        assert "create_weights" in r7_refusal["message"] and "expert parallelism" in r7_refusal["message"]
        assert r7_refusal["location"]["tensor"] == "quantization_config.scope"
    if pr766_refusal:
        assert "128" in pr766_refusal["message"]
        assert pr766_refusal["location"]["tensor"] == "text_config.moe_intermediate_size"


def test_pr766_lists_the_tp_degrees_the_shapes_allow(capsys, stream):
    _, doc = validate(capsys, stream)
    verdict = {v["name"]: v for v in doc["engines"]}
    assert verdict["vllm-exl3-pr766"]["tp_accepted"] == [1, 2, 4]  # I 512: 512, 256, 128 per rank
    assert verdict["vllm-exl3-r7"]["tp_accepted"] == [2]


@pytest.mark.parametrize("k", [6, 8, 2])
def test_k6_k8_k2_releases_are_refused_by_name(capsys, tmp_path, k):
    root = synth_stream(capsys, tmp_path / f"k{k}", "--uniform", str(k))
    _, doc = validate(capsys, root)
    assert not codes(doc, engine=False)  # a valid stream at its K
    scope = next(f for f in doc["findings"] if f["code"] == "engine.glm53-scope")
    assert scope["location"]["tensor"] == "quantization_config.bits" and scope["found"] == k
    verdict = next(v for v in doc["engines"] if v["name"] == "vllm-exl3-r7")
    assert any(r["reason"].startswith(f"a K{k} release") for r in verdict["reasons"])
    assert "engine.glm53-k" in {r["code"] for r in verdict["reasons"]}


def test_pr766_is_listed_only_for_the_scope(capsys, tmp_path):
    _, doc = validate(capsys, tiny_checkpoint(tmp_path))
    assert "vllm-exl3-pr766" not in {v["name"] for v in doc["engines"]}
    code, doc = validate(capsys, tiny_checkpoint(tmp_path, "again"), "--engine", "vllm-exl3-pr766")
    assert code == 1 and "engine.container" in codes(doc, engine=True)


@pytest.fixture(scope="module")
def flash(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("flash") / "flash"
    assert run_cli(None, "synth", str(out), "--preset", "glm53-flash", "--sparse")[0] == 0
    return out


@pytest.mark.slow
def test_glm53_flash_loads_at_tp2_and_pr766_at_any_aligned_tp(capsys, flash):
    code, doc = validate(capsys, flash)
    verdict = {v["name"]: v for v in doc["engines"]}
    assert doc["context"]["dialect"] == DIALECT_GLM53 and doc["checked"]["tensors"] == 148608 + 178
    assert code == 0 and verdict["vllm-exl3-r7"]["loads"] and verdict["vllm-exl3-r7"]["tp_accepted"] == [2]
    assert verdict["vllm-exl3-pr766"]["loads"] and verdict["vllm-exl3-pr766"]["tp_accepted"] == [1, 2, 4, 8, 16]
    code, doc = validate(capsys, flash, "--tp", "4")
    assert code == 1 and codes(doc, engine=True) == {"engine.tp"}
    code, doc = validate(capsys, flash, "--tp", "4", "--engine", "vllm-exl3-pr766")
    assert code == 0
    code, doc = validate(capsys, flash, "--tp", "32", "--engine", "vllm-exl3-pr766")
    assert code == 1 and codes(doc, engine=True) == {"engine.tp"}


# ---- 4. fit -----------------------------------------------------------------------------------------------

def test_fit_refuses_glm5_next_text_by_name(capsys, stream):
    code, _, err = run_cli(capsys, "fit", str(stream), "--tp", "2", "--gpu", "rtx-pro-6000")
    assert code != 0 and "glm5_next_text" in err and "full_attn_layers" in err


# ---- 5. diff -----------------------------------------------------------------------------------------------

def test_diff_compares_streams_unit_by_unit(capsys, tmp_path, stream):
    code, out, _ = run_cli(capsys, "diff", str(stream), str(copy(stream, tmp_path)), "--json")
    assert code == 0 and json.loads(out)["identical"]
    other = synth_stream(capsys, tmp_path / "seed1", "--seed", "1")
    code, out, _ = run_cli(capsys, "diff", str(stream), str(other), "--json")
    doc = json.loads(out)
    assert code == 1 and not doc["identical"]


# ---- 6. repack ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2, 4])
def test_stream_to_tr3_and_back_is_bit_for_bit(capsys, tmp_path, stream, tp):
    tr3, back = tmp_path / "tr3", tmp_path / "back"
    code, _, err = run_cli(capsys, "repack", str(stream), str(tr3), "--to", "tr3", "--tp", str(tp))
    assert code == 0, err
    ck = open_checkpoint(tr3)
    assert ck.tp == tp and ck.intermediate == 512 and sorted(ck.layers) == [3, 4, 5]
    assert validate(capsys, tr3)[0] == 0  # a valid TR3 its default loader takes
    # Rank r holds output tiles [r*I/tp, (r+1)*I/tp) of gate: the stream's tensor, narrowed.
    full = load_file(str(stream / LAYER3))["model.language_model.layers.3.mlp.experts.2.gate_proj.trellis"]
    width = 512 // 16 // tp
    for rank in range(tp):
        lin = ck.layers[3].experts[2]["gate_proj"][rank]
        from trellis_cli.checkpoint.tensors import read_tensor

        assert torch.equal(read_tensor(ck, lin.trellis), full[:, rank * width:(rank + 1) * width])
    code, _, err = run_cli(capsys, "repack", str(tr3), str(back), "--to", "glm53-stream")
    assert code == 0, err
    same_tree(stream, back)


def test_a_tp_the_shapes_do_not_allow_is_refused_by_rule(capsys, tmp_path, stream):
    code, _, err = run_cli(capsys, "repack", str(stream), str(tmp_path / "o"), "--to", "tr3", "--tp", "8")
    assert code == 2 and "128-channel" in err and "_validate_moe_shapes" in err and not (tmp_path / "o").exists()


def test_the_stream_converts_through_tr3_only(capsys, tmp_path, stream):
    code, _, err = run_cli(capsys, "repack", str(stream), str(tmp_path / "o"), "--to", "route-pack")
    assert code == 2 and "--to tr3" in err


def test_a_tr3_not_made_from_a_stream_does_not_convert_back(capsys, tmp_path):
    code, _, err = run_cli(capsys, "repack", str(tiny_checkpoint(tmp_path)), str(tmp_path / "o"), "--to",
                           "glm53-stream")
    assert code == 2 and "glm53_stream_source" in err and not (tmp_path / "o").exists()


def test_differing_hidden_side_vectors_are_refused_not_merged(capsys, tmp_path, stream):
    tr3 = tmp_path / "tr3"
    assert run_cli(capsys, "repack", str(stream), str(tr3), "--to", "tr3", "--tp", "2")[0] == 0
    shard = LAYER3
    key = "model.layers.3.mlp.experts.1.gate_proj.rank1.suh"
    rebuild_shard(tr3, shard, lambda t: t.__setitem__(key, -t[key]))
    (tr3 / "MANIFEST.sha256").unlink()
    code, _, err = run_cli(capsys, "repack", str(tr3), str(tmp_path / "o"), "--to", "glm53-stream")
    assert code != 0 and "glm53.h-side-differs" in err and not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.parametrize("onward", ["exl3-v1", "route-pack"])
def test_onward_through_tr3_and_back_is_bit_for_bit(capsys, tmp_path, stream, onward):
    tr3, mid, tr3_again, back = (tmp_path / n for n in ("tr3", "mid", "tr3b", "back"))
    assert run_cli(capsys, "repack", str(stream), str(tr3), "--to", "tr3", "--tp", "4")[0] == 0
    assert run_cli(capsys, "repack", str(tr3), str(mid), "--to", onward)[0] == 0
    again = ["--tp", "2"] if onward == "exl3-v1" else []
    assert run_cli(capsys, "repack", str(mid), str(tr3_again), "--to", "tr3", *again)[0] == 0
    code, _, err = run_cli(capsys, "repack", str(tr3_again), str(back), "--to", "glm53-stream")
    assert code == 0, err
    same_tree(stream, back)


def test_inspect_tp_prices_each_rank_of_the_cut_stream(capsys, stream):
    code, out, _ = run_cli(capsys, "inspect", str(stream), "--tp", "4", "--json")
    doc = json.loads(out)["serve_tp"]
    # Per (expert, projection) on one of 4 ranks: a quarter of the trellis [16, 32, 64] int16 and of the
    # intermediate-side vector [512] fp16, the hidden-side vector [256] fp16 whole, the 4-byte marker.
    per_linear = 16 * 32 * 64 * 2 // 4 + 512 * 2 // 4 + 256 * 2 + 4
    assert code == 0 and [row["bytes_per_rank"] for row in doc["layers"]] == [8 * 3 * per_linear] * 3
    assert doc["engines"]["vllm-exl3-r7"]["accepts"] is False and doc["engines"]["vllm-exl3-pr766"]["accepts"]


def test_the_non_routed_dtype_policy_must_be_exact(capsys, tmp_path, stream):
    root = copy(stream, tmp_path)
    edit_json(root / "config.json", lambda c: c["quantization_config"].update(non_routed_dtype_policy="bf16"))
    _, doc = validate(capsys, root)
    scope = next(f for f in doc["findings"] if f["code"] == "engine.glm53-scope")
    assert scope["location"]["tensor"] == "quantization_config.non_routed_dtype_policy"
    assert scope["expected"] == "official_source_native" and scope["found"] == "bf16"


def test_diff_sees_the_tr3_form_as_the_same_experts(capsys, tmp_path, stream):
    tr3 = tmp_path / "tr3"
    assert run_cli(capsys, "repack", str(stream), str(tr3), "--to", "tr3", "--tp", "2")[0] == 0
    code, out, _ = run_cli(capsys, "diff", str(stream), str(tr3), "--json")
    doc = json.loads(out)
    # Compared at TP 2 (the stream cut as a server would): every unit equal; only the declarations differ.
    assert doc["compared_tp"] == 2 and doc["identical"] and not doc["differences"]
    assert doc["counts"]["identical"] == 3 * 8 * 3 * 3 * 2 + 18  # (layer, expert, proj, part, rank) + others
    assert doc["structure"]


@pytest.mark.slow
def test_one_architecture_field_off_is_refused_by_that_field(capsys, flash):
    config = flash / "config.json"
    original = config.read_text()
    try:
        edit_json(config, lambda c: c["text_config"].update(index_kpool=8))
        code, doc = validate(capsys, flash)
        refusal = next(f for f in doc["findings"] if f["code"] == "engine.glm53-architecture")
        assert code == 1 and refusal["location"]["tensor"] == "text_config.index_kpool"
        assert refusal["expected"] == {"index_kpool": 4} and refusal["found"] == {"index_kpool": 8}
    finally:
        config.write_text(original)


def test_a_stream_on_the_hub_validates_from_headers_alone(capsys, tmp_path, stream):
    from hub_server import HubServer

    _, local = validate(capsys, stream)
    with HubServer() as hub:
        hub.add_commit("org/glm53-tiny", stream)
        code, out, err = run_cli(capsys, "validate", "org/glm53-tiny", "--endpoint", hub.endpoint, "--cache-dir",
                                 str(tmp_path / "cache"), "--json")
        tensor_bytes = hub.tensor_bytes_past_window(HEADER_WINDOW)
    remote = json.loads(out)
    assert remote["context"]["dialect"] == DIALECT_GLM53, err
    assert codes(remote) == codes(local) and code == 1  # the same verdicts, markers aside (not read remotely)
    assert tensor_bytes == 0 and "marker.not-read" in {f["code"] for f in remote["findings"]}


def _as_a_release(stream: Path, out: Path) -> Path:
    """The stream re-sharded as releases are, by safetensors itself: a layer spread over two files, the
    non-routed tensors in a file with routed ones."""
    from safetensors.torch import save_file

    out.mkdir()
    for name in ("config.json", "quantization_config.json"):
        shutil.copy(stream / name, out / name)
    tensors: dict = {}
    for f in sorted(stream.glob("*.safetensors")):
        tensors.update(load_file(str(f)))

    def part(name: str) -> str:
        if ".mlp.experts." not in name:
            return "part-a.safetensors"
        layer, expert = int(name.split(".layers.")[1].split(".")[0]), int(name.split(".experts.")[1].split(".")[0])
        return "part-a.safetensors" if layer == 3 and expert < 5 else \
            "part-b.safetensors" if layer in (3, 4) else "part-c.safetensors"

    files: dict[str, dict] = {}
    for name, t in tensors.items():
        files.setdefault(part(name), {})[name] = t
    for name, group in files.items():
        save_file(group, str(out / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {n: part(n) for n in sorted(tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, separators=(",", ":")))
    return out


def test_a_release_spread_over_files_comes_back_in_the_same_files(capsys, tmp_path, stream):
    release = _as_a_release(stream, tmp_path / "release")
    _, doc = validate(capsys, release)
    assert not codes(doc, engine=False)
    tr3, back = tmp_path / "tr3", tmp_path / "back"
    assert run_cli(capsys, "repack", str(release), str(tr3), "--to", "tr3", "--tp", "2")[0] == 0
    code, _, err = run_cli(capsys, "repack", str(tr3), str(back), "--to", "glm53-stream")
    assert code == 0, err
    same_tree(release, back)  # every file byte for byte, safetensors' own layout included
