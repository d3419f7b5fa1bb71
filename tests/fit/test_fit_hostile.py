"""Hostile input to `trellis fit` (and `inspect --tensors`): every search bounded, every geometry the engine
cannot build a named error (exit 1), every oversized number named, never a traceback or a hang."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from helpers import run_cli
from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
from trellis_cli.synth import preset, write_checkpoint

ARGS = ("--tp", "2", "--gpu", "h100", "--ctx", "2048")


@pytest.fixture()
def tiny(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "t", preset("tiny"))


def with_config(root: Path, **changes) -> str:
    path = root / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return str(root)


def fit(capsys, *args):
    started = time.monotonic()
    code, out, err = run_cli(capsys, "fit", *args)
    assert time.monotonic() - started < 20, "fit must not search without bound"
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


@pytest.mark.parametrize("changes", [
    {"hidden_size": 128 * 1_000_000_007, "num_experts_per_tok": 0},
    {"num_hidden_layers": 0}, {"n_routed_experts": 0}, {"hidden_size": 0}, {"num_attention_heads": 0},
    {"kv_lora_rank": 0}, {"kv_lora_rank": 0, "qk_rope_head_dim": 0, "index_head_dim": 0, "v_head_dim": 0},
    {"num_experts_per_tok": 9999}, {"indexer_types": ["full"]}, {"index_topk_freq": 0},
    {"hidden_size": 10 ** 5000 // 10 ** 4000}, {"num_hidden_layers": "78"},
])
def test_geometry_the_engine_cannot_build_is_a_named_error(tiny, capsys, changes):
    code, _, err = fit(capsys, with_config(tiny, **changes), *ARGS)
    assert code == 1, err
    assert err.startswith("error: config.json: ") and len(err.splitlines()[0]) < 300


def test_max_position_embeddings_zero_without_ctx(tiny, capsys):
    code, _, err = fit(capsys, with_config(tiny, max_position_embeddings=0), "--tp", "2", "--gpu", "h100")
    assert code == 1 and "max_position_embeddings is 0" in err


def test_a_huge_hidden_size_with_one_batched_token_is_arithmetic(tiny, capsys):
    code, out, err = fit(capsys, with_config(tiny, hidden_size=128 * 1_000_000_007), *ARGS,
                         "--max-num-batched-tokens", "1")
    assert code == 1 and "does not fit" in out  # terabytes of attention weights: an answer, at once


@pytest.mark.parametrize(("args", "words"), [
    (("--gpu-mem", "9" * 400, "--arch", "sm_90"), "(400 characters) is not a size"),
    (("--gpu-mem", "9" * 400 + "GiB", "--arch", "sm_90"), "is not a size"),
    (("--gpu-mem", "99999999TiB", "--arch", "sm_90"), "larger than any GPU"),
    (("--gpu", "h100", "--ctx", "9" * 400), "not a token count"),
    (("--gpu", "h100", "--ctx", "1.5K"), "no decimals with a binary suffix"),
    (("--gpu", "h100", "--tp", "99999999999"), "more GPUs"),
])
def test_oversized_numbers_are_named_usage_errors(tiny, capsys, args, words):
    base = ["--tp", "2"] if "--tp" not in args else []
    code, _, err = fit(capsys, str(tiny), *base, *args)
    assert code == 2 and words in err, err


def _rename_a_tensor(root: Path, new_name: str) -> None:
    """Rewrite one shard header with one tensor renamed (data offsets unchanged)."""
    shard = sorted(root.glob("*.safetensors"))[0]
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    old = next(k for k in header if k != "__metadata__")
    header[new_name] = header.pop(old)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    shard.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])
    index = root / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        doc["weight_map"][new_name] = doc["weight_map"].pop(old)
        index.write_text(json.dumps(doc))


def test_a_layer_number_of_5000_digits(tiny, capsys):
    _rename_a_tensor(tiny, "model.layers." + "7" * 5000 + ".self_attn.o_proj.weight")
    code, _, err = fit(capsys, str(tiny), *ARGS)
    assert code == 1 and "5,000 digits" in err and len(err) < 1000
    code, _, err = run_cli(capsys, "inspect", str(tiny), "--tensors")
    assert code == 1 and "5,000 digits" in err and "Traceback" not in err


def test_an_exl3v1_manifest_of_2_to_the_24_slots(tmp_path, capsys):
    root = write_exl3v1_checkpoint(tmp_path / "v", preset("tiny"))
    manifest = root / "exl3-manifest.json"
    doc = json.loads(manifest.read_text())
    doc["geometry"]["num_slots"] = 1 << 24
    manifest.write_text(json.dumps(doc))
    code, _, err = fit(capsys, str(root), "--tp", "1", "--gpu", "h100", "--ctx", "1024")
    assert code == 1 and "exl3-manifest.json" in err  # a damaged source: exit 1, not a usage error


def test_source_is_required(capsys):
    code, _, err = fit(capsys, "--tp", "2", "--gpu", "h100")
    assert code == 2 and "SOURCE is required" in err and "model_type" not in err
