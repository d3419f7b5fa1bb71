"""Validation rules on real synthesized checkpoints: clean ones pass in every supported shape, and each rule
family reports its own code with expected vs found."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path
from dataclasses import replace

import pytest
import torch

from corrupt import INDEX, SHARD3, edit_json, key, rebuild_shard, write_tensor_bytes
from helpers import run_cli, tiny_checkpoint, to_plain_exl3, to_r7, to_r7_v2, error_line
from trellis_cli.sources import HEADER_WINDOW
from trellis_cli.dialects import open_checkpoint
from trellis_cli.findings import Location, Severity, error
from trellis_cli.sample import sample_path
from trellis_cli.synth import SynthSpec, write_checkpoint
from trellis_cli.validate import cap_findings, run_validation
from trellis_cli.validate.rules_tensors import LayerContext, expected_tensor_count


def codes(report, severity: Severity | None = Severity.ERROR) -> set[str]:
    return {f.code for f in report.findings if severity is None or f.severity is severity}


def validate(root, **kwargs):
    return run_validation(open_checkpoint(root), **kwargs)


@pytest.mark.parametrize("changes", [
    {},
    {"rotation_layout": "shared_h_v1", "bitmap_field": "bits_per_expert"},
    {"partition": None, "uniform_k": 3},
    {"partition": (2, 6), "k_values": (3, 5), "tp": 1},
    {"partition": (4, 4), "tp": 4, "hidden": 128, "intermediate": 512, "rotation_layout": "shared_h_v1"},
], ids=["per-expert", "shared-h", "uniform-k3", "k3-k5-tp1", "tp4-shared-h"])
def test_clean_synth_checkpoints_pass_deep(tmp_path, changes):
    report = validate(tiny_checkpoint(tmp_path, **changes), deep=True)
    assert report.ok and not report.warnings, [f.line() for f in report.findings]
    assert report.checked["layers"] == 2 and report.checked["tiles decoded"] > 0


@pytest.mark.parametrize("name", ["tr3", "tr3-shared-h"])
def test_bundled_samples_pass(name):
    report = validate(sample_path(name), deep=True)
    assert report.ok and not report.warnings, [f.line() for f in report.findings]


def test_validation_keeps_no_reference_to_the_checkpoint():
    """A validated checkpoint is freed once its caller drops it: a module-level memo of the engine profiles held the
    last one (~400 MB at production size) until the next validation or the interpreter's exit."""
    checkpoint = open_checkpoint(sample_path("tr3"))
    held = weakref.ref(checkpoint)
    assert run_validation(checkpoint).ok
    del checkpoint
    gc.collect()
    assert held() is None


def test_r7_manifest_layer_that_is_not_a_number_is_a_finding(tmp_path):
    root = to_r7(tiny_checkpoint(tmp_path))
    name = sorted(root.glob("r7-experts-layer-*.json"))[0]
    (root / name.name).write_text(json.dumps({"layer": "three", "bits": json.loads(name.read_text())}))
    report = validate(root)
    bad = [f for f in report.findings if f.code == "bitmap.unreadable"]
    assert bad and bad[0].where.file == name.name and "three" in str(bad[0].found)


def test_plain_exl3_and_r7_pass(tmp_path):
    # the format rules alone (no profile enforced): exllamav3 would refuse its per-expert K
    assert validate(to_plain_exl3(tiny_checkpoint(tmp_path, "a", tp=1)), deep=True, engine=None).ok
    assert validate(to_r7(tiny_checkpoint(tmp_path, "b")), deep=True, engine=None).ok
    # under R7's default profile, the fork's R7 loader: a complete v2 checkpoint (schema, rank-free names, ...)
    assert validate(to_r7_v2(tiny_checkpoint(tmp_path, "c", tp=1)), deep=True).ok


def test_plain_exl3_with_per_expert_k_is_refused_by_exllamav3(tmp_path):
    # exllamav3 (the default profile of plain exl3) fuses a layer's experts per projection: one K for all
    report = validate(to_plain_exl3(tiny_checkpoint(tmp_path, tp=1)), engine="default")
    refused = [f for f in report.errors if f.code == "engine.k-per-projection"]
    assert refused and refused[0].engine == "exllamav3" and refused[0].found["K"] == [3, 4]


def test_tensor_count_formula_matches_production_numbers():
    ctx = LayerContext(3, 256, 4, 6144, 512, "mcg", True, False)
    assert expected_tensor_count(ctx) == 12_288
    assert expected_tensor_count(replace(ctx, shared=True)) == 9_228


@pytest.mark.parametrize("edit,code", [
    (lambda h: h.update(codebook="mul1"), "config.tr3-codebook"),
    (lambda h: h.pop("tp"), "config.tr3-key-missing"),
    (lambda h: h.update(tensor_schema="model.layers.{L}.experts.{E}"), "config.tr3-tensor-schema"),
    (lambda h: h.update(moe_layers=[4, 3]), "config.tr3-moe-layers"),
    (lambda h: h.update(k_values=[3, 9]), "config.tr3-k-values"),
    (lambda h: h.update(shared_h_tensor_schema="x"), "config.tr3-shared-h-schema"),
    (lambda h: h.update(experts_per_layer=6), "expert.extra"),
    (lambda h: h.update(bits_per_expert="tier_bitmap.json"), "bitmap.reference"),
    (lambda h: h.update(bits_per_expert="missing.json:k"), "bitmap.missing"),
    (lambda h: h.update(tp=4), "rank.missing"),
    (lambda h: h.update(protected_tensor_policy={"format": "exl3-protected-v0", "tensors": {}}),
     "config.protected-policy"),
    (lambda h: h.update(protected_tensor_policy={"format": "exl3-protected-v1", "tensors": {
        "model.layers.0.self_attn.q_proj": {"bits": 6, "codebook": "mcg"}}}), "config.protected-missing"),
    (lambda h: h.update(protected_tensor_policy={"format": "exl3-protected-v1", "tensors": {
        "model.layers.3.mlp.experts.0.gate_proj.rank0": {"bits": True, "codebook": "mcg"}}}),
     "config.protected-policy"),
])
def test_contract_violations(tmp_path, edit, code):
    root = tiny_checkpoint(tmp_path)
    edit_json(root / "config.json", lambda c: edit(c["hybrid_tr3_tail"]))
    report = validate(root)
    assert code in codes(report), [f.line() for f in report.findings]


def test_a_protected_tensor_stored_at_another_k_than_declared_is_a_warning(tmp_path):
    """The shared-H loader checks the declaration against tensor_storage's record, never the stored tensor's K
    (issue 52): stored K3/K4, declared 8, is said, not refused by the format rules."""
    root = tiny_checkpoint(tmp_path)
    edit_json(root / "config.json", lambda c: c["hybrid_tr3_tail"].update(protected_tensor_policy={
        "format": "exl3-protected-v1", "tensors": {"model.layers.3.mlp.experts.0.gate_proj.rank0": {
            "bits": 8, "codebook": "mcg"}}}))
    report = validate(root)
    assert "config.protected-stored-k" in codes(report, Severity.WARNING)
    assert "config.protected-k" not in codes(report)


def test_k_inconsistent_across_ranks(tmp_path):
    root = tiny_checkpoint(tmp_path)
    name = key(3, 2, "up_proj", 1, "trellis")

    def swap(tensors):
        k = tensors[name].shape[-1] // 16
        tensors[name] = torch.randint(-32768, 32767, (*tensors[name].shape[:2], 16 * (7 - k)), dtype=torch.int16)

    rebuild_shard(root, SHARD3, swap)
    report = validate(root)
    found = [f for f in report.findings if f.code == "expert.k-inconsistent"]
    assert found and found[0].where == Location(layer=3, expert=2) and found[0].found == [3, 4]


def test_shared_h_leftover_and_missing_rows(tmp_path):
    root = tiny_checkpoint(tmp_path, rotation_layout="shared_h_v1")
    leftover = key(3, 0, "gate_proj", 0, "suh")
    shared_row = "model.layers.3.mlp.experts.shared_h.down_proj.rank1.svh"

    def edit(tensors):
        tensors[leftover] = torch.randn(256).half()
        tensors.pop(shared_row)

    rebuild_shard(root, SHARD3, edit)
    report = validate(root)
    assert {"shared-h.leftover", "shared-h.missing"} <= codes(report)


def test_shared_h_rows_in_per_expert_layout_are_rejected(tmp_path):
    root = tiny_checkpoint(tmp_path)
    rebuild_shard(root, SHARD3, lambda t: t.update(
        {"model.layers.3.mlp.experts.shared_h.up_proj.rank0.suh": torch.randn(256).half()}))
    assert "shared-h.unexpected" in codes(validate(root))


def test_missing_marker_and_unexpected_fields(tmp_path):
    root = tiny_checkpoint(tmp_path)

    def edit(tensors):
        tensors.pop(key(3, 1, "gate_proj", 0, "mcg"))
        tensors[key(3, 1, "gate_proj", 1, "bias")] = torch.randn(128).half()
        tensors[key(3, 1, "gate_proj", 1, "scale")] = torch.randn(1).half()

    rebuild_shard(root, SHARD3, edit)
    report = validate(root)
    assert {"marker.missing", "tensor.bias"} <= codes(report)
    assert "tensor.scale-ignored" in codes(report, Severity.WARNING)


def test_index_disagreements_both_ways(tmp_path):
    root = tiny_checkpoint(tmp_path)

    def edit(index):
        index["weight_map"].pop(key(3, 0, "gate_proj", 0, "svh"))
        index["weight_map"]["model.layers.3.mlp.experts.0.gate_proj.rank0.ghost"] = SHARD3
        index["weight_map"]["model.layers.9.norm.weight"] = "model-00009.safetensors"
        index["metadata"]["total_size"] += 2

    edit_json(root / INDEX, edit)
    report = validate(root)
    assert {"index.unindexed", "index.missing-tensor", "index.file-missing"} <= codes(report)
    assert "index.total-size" not in codes(report, None)  # not summable while a listed shard is missing


def test_tier_larger_than_256_experts(tmp_path):
    spec = SynthSpec(hidden=128, intermediate=128, experts=300, tp=1, layers=(3,), partition=(290, 10),
                     sparse=True, top_k=2)
    report = validate(write_checkpoint(tmp_path / "wide", spec))
    found = [f for f in report.findings if f.code == "tier.too-large"]
    assert len(found) == 1 and found[0].found == 290


def test_deep_warns_on_zero_svh_and_constant_trellis(tmp_path):
    root = tiny_checkpoint(tmp_path)
    ckpt = open_checkpoint(root)
    lin = ckpt.layers[3].experts[ckpt.layers[3].partition()[3][0]]["gate_proj"][0]
    write_tensor_bytes(root / SHARD3, lin.svh.name, bytes(4))
    write_tensor_bytes(root / SHARD3, lin.trellis.name, bytes(lin.trellis.nbytes))
    report = validate(root, deep=True)
    assert {"data.svh-zero", "data.constant-trellis"} <= codes(report, Severity.WARNING)
    assert report.ok


def test_cap_keeps_first_findings_and_counts_the_rest():
    from trellis_cli.findings import Report, error_summary

    many = [error("x.y", Location(layer=i), "m") for i in range(75)] + [error("a.b", Location(), "m")]
    report = Report("s", findings=many + [error_summary("x.y", Location(layer=9), 7, "missing things")])
    cap_findings(report, limit=50)
    assert len(report.findings) == 52 and all(f.where != Location() or f.code == "a.b" for f in report.findings)
    assert report.omitted == {("x.y", Severity.ERROR): 25}
    assert report.counts()["by_code"] == {"a.b": {"error": 1}, "x.y": {"error": 75 + 7}}
    assert report.error_count == 83 and "83 error(s)" in report.summary()


def test_layers_option_limits_per_layer_rules(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path)
    code, out, _ = run_cli(capsys, "validate", str(root), "--layers", "4", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["checked"]["layers"] == 1 and doc["findings"] == []
    assert doc["source"]["kind"] == "local" and "revision" in doc
    code, out, err = run_cli(capsys, "validate", str(root), "--layers", "4,9", "--json")
    assert code == 2 and out == "" and error_line(err) == "error: --layers: [9] not in the source (it has 3-4)"


def test_strict_fails_on_warnings(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path)
    edit_json(root / INDEX, lambda i: i["metadata"].update(total_size=1))
    assert run_cli(capsys, "validate", str(root))[0] == 0
    code, out, err = run_cli(capsys, "validate", str(root), "--strict")
    assert code == 1 and "[index.total-size]" in out and error_line(err).startswith("error:")


def test_default_source_is_the_bundled_sample(capsys):
    code, out, _ = run_cli(capsys, "validate")
    verdict, engines = out.strip().splitlines()[-2:]
    assert code == 0 and verdict.startswith("PASS: bundled sample")
    assert engines == ("loads on: vllm-exl3 (shared-H rules) ✓ TP 2 · vllm-exl3 (#190 rules) ✓ TP 2 · "
                       "vllm-exl3 (R7 rules) ✓ TP 2 · vllm-exl3 (manifest rules) ✗ wrong container · "
                       "b12x exl3-v1 ✗ wrong container · b12x 1.3.0 ✗ wrong container · "
                       "exllamav3 ✗ rank-sliced names")


def test_route_pack_is_validated_by_its_own_verifier(tmp_path, capsys):
    packed = tmp_path / "packed"
    assert run_cli(capsys, "repack", str(sample_path("tr3")), str(packed), "--json")[0] == 0
    code, out, _ = run_cli(capsys, "validate", str(packed), "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and doc["context"]["dialect"] == "trellis-route-pack"
    (packed / "manifest.json").write_text(json.dumps({**json.loads((packed / "manifest.json").read_text()),
                                                      "schema_version": 99}))
    assert run_cli(capsys, "validate", str(packed))[0] == 1


def test_checksums_against_manifest(tmp_path, capsys):
    root = tiny_checkpoint(tmp_path)
    assert run_cli(capsys, "validate", str(root), "--checksums")[0] == 0
    write_tensor_bytes(root / SHARD3, key(3, 5, "up_proj", 0, "trellis"), b"\x01\x02")  # same size, new content
    code, out, _ = run_cli(capsys, "validate", str(root), "--checksums", "--json")
    doc = json.loads(out)
    found = [f for f in doc["findings"] if f["code"] == "checksum.mismatch"]
    assert code == 1 and found[0]["location"] == {"file": SHARD3} and len(found[0]["expected"]) == 64
    assert "checksum.mismatch" not in codes(validate(root))  # header-only validate cannot see it


@pytest.mark.slow
def test_production_layers_header_only(tmp_path):
    import time

    from trellis_cli.synth import non_expert_plan, preset

    spec = replace(preset("glm52-tp4"), layers=(3, 4, 5, 6), sparse=True, num_hidden_layers=7, mtp_layers=0,
                   non_expert="bf16")
    root = write_checkpoint(tmp_path / "glm", spec)
    start = time.perf_counter()
    report = validate(root)
    elapsed = time.perf_counter() - start
    assert report.checked["tensors"] == 4 * 12_288 + len(non_expert_plan(spec)) and report.checked["linears"] == 4 * 3072
    # The markers are read by default; a sparse file still holds real markers, so it passes.
    assert report.checked["markers read"] == 4 * 3072 and report.ok, codes(report)
    assert elapsed < 15, elapsed  # ~0.3 s per layer on 2 cores; 76 layers in docs/performance.md


@pytest.mark.slow
@pytest.mark.parametrize("flag,layer", [("--deep", 4), ("--download", 3)])
def test_deep_through_the_hub_downloads_only_the_chosen_layer(tmp_path, flag, layer):
    import os
    import subprocess
    import sys

    from hub_server import HubServer

    served = tiny_checkpoint(tmp_path, "served")
    with HubServer() as hub:
        sha = hub.add_commit("org/tiny", served)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "home"),
                   HF_HUB_DISABLE_PROGRESS_BARS="1")
        result = subprocess.run([sys.executable, "-m", "trellis_cli", "validate", "org/tiny", flag, "--layers",
                                 str(layer), "--json"], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        doc = json.loads(result.stdout)
        assert doc["revision"] == sha
        # --download only fetches; --deep also reads the data it fetched
        assert (doc["checked"].get("tiles decoded", 0) > 0) == (flag == "--deep")
        tensor_bytes = hub.tensor_bytes_past_window_by_file(HEADER_WINDOW)  # header reads aside
        assert list(tensor_bytes) == [f"model-layer-{layer:03d}.safetensors"]


def test_every_finding_code_is_documented():
    import ast
    import re

    root = Path(__file__).resolve().parents[2]
    modules = [*(root / "trellis_cli" / "validate").glob("*.py"), *(root / "trellis_cli" / "checkpoint").glob("*.py"),
               root / "trellis_cli" / "cli" / "validate_cmd.py"]
    code_like = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*\.[a-z0-9]+(-[a-z0-9]+)*$")
    not_codes = {"json", "safetensors", "sha256"}
    found = {node.value for path in modules for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and code_like.match(node.value)
             and node.value.rsplit(".", 1)[1] not in not_codes}
    documented = set(re.findall(r"`([a-z0-9-]+\.[a-z0-9-]+)`", (root / "docs" / "findings.md").read_text()))
    assert len(found) > 60 and found <= documented, sorted(found - documented)


def test_r7_v2_layer_shared_vectors(tmp_path):
    """R7 v2 (topology-neutral): unsliced experts, hidden-side vectors once per layer under experts.r7_shared."""
    from safetensors.torch import load_file, save_file

    root = to_r7(tiny_checkpoint(tmp_path, tp=1))
    for shard in sorted(root.glob("model-layer-*.safetensors")):
        layer = int(shard.stem.rsplit("-", 1)[1])
        tensors = {k.replace(".rank0.", "."): v for k, v in load_file(str(shard)).items()
                   if not k.endswith(("gate_proj.rank0.suh", "up_proj.rank0.suh", "down_proj.rank0.svh"))}
        tensors[f"model.layers.{layer}.mlp.experts.r7_shared.gate_up_suh"] = torch.randn(256).half()
        tensors[f"model.layers.{layer}.mlp.experts.r7_shared.down_svh"] = torch.randn(256).half()
        save_file(tensors, str(shard), metadata={"format": "pt"})
    (root / INDEX).unlink()
    ckpt = open_checkpoint(root)
    assert ckpt.dialect == "r7" and set(ckpt.layers[3].r7_shared) == {"gate_up_suh", "down_svh"}
    report = run_validation(ckpt, deep=True, engine=None)  # the format rules (the R7 loader's: test_loader_verdicts)
    assert report.ok, [f.line() for f in report.findings]
