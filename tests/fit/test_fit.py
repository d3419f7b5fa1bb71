"""`trellis fit`: weights per rank exact from headers, the KV formulas, the reserve, remedies and exit codes.

Every expected number here is computed by hand or read back independently from the safetensors headers
(raw JSON, not through the checkpoint model).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import run_cli, to_plain_exl3, to_r7
from hub_server import HubServer
from trellis_cli.sources import HEADER_WINDOW
from trellis_cli.dialects import open_checkpoint
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
from trellis_cli.fit.arch import read_arch
from trellis_cli.fit.gpus import GIB, PRESETS, Gpu, parse_size
from trellis_cli.fit.engines import ENGINES, FORK, UPSTREAM, resolve_layout
from trellis_cli.fit.kv import indexer_bytes, kv_per_token
from trellis_cli.fit.reserve import reserve_terms
from trellis_cli.fit.run import FitRequest, fit
from trellis_cli.fit.sharding import COLUMN, REPLICATED, ROW, VOCAB, slice_bytes
from trellis_cli.sources import open_source
from trellis_cli.synth import GLM_MOE_DSA, preset, write_checkpoint

DTYPE_BYTES = {"I16": 2, "F16": 2, "BF16": 2, "I32": 4, "F32": 4, "U8": 1}
RANK = re.compile(r"\.rank([0-9]+)\.")


def tiny_experts_only():
    """The tiny preset's routed experts alone (the byte accounting here counts them; the preset also writes
    the other weights now, which fit counts as present)."""
    return dataclasses.replace(preset("tiny"), non_expert="none")


def glm5_config(**changes) -> dict:
    """GLM-5's config.json fields (GlmMoeDsaConfig defaults: 78 layers, 3 dense, 1 MTP)."""
    return {"model_type": "glm_moe_dsa", "hidden_size": 6144, "num_hidden_layers": 78, "num_nextn_predict_layers": 1,
            "first_k_dense_replace": 3, "moe_intermediate_size": 2048, "n_routed_experts": 256,
            "num_experts_per_tok": 8, **GLM_MOE_DSA, **changes}


def header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        doc = json.loads(f.read(n))
    doc.pop("__metadata__", None)
    return doc


def nbytes(entry: dict) -> int:
    return entry["data_offsets"][1] - entry["data_offsets"][0]


def gpu(gib: float, family: str = "sm_90") -> Gpu:
    return Gpu("test", "test GPU", int(gib * GIB), family)


# ---- KV cache ------------------------------------------------------------------------------------------

def kv(arch, stored_as: str, dcp: int, mtp: bool, engine: str = FORK, family: str = "sm_90"):
    """KV per token for a dtype on a family where the engine stores it as asked (sm_90 bf16 / fp8_ds_mla)."""
    layout = resolve_layout(ENGINES[engine], family, stored_as, dcp, 8, arch.kv_lora_rank, arch.qk_rope)
    return kv_per_token(arch, layout, dcp, mtp, ENGINES[engine])


def test_glm5_kv_per_token_all_layers_dcp_and_mtp():
    arch = read_arch(glm5_config())
    assert indexer_bytes(arch) == 128 + 4  # fp8 key of index_head_dim 128, one fp32 scale
    assert kv(arch, "bf16", 1, mtp=False).rank_bytes == 78 * (1152 + 132) == 100_152
    # fp8 is stored as fp8_ds_mla on sm_90; DCP 4, MTP loaded: 79 layers of 656 + 132 bytes over 4 ranks
    k = kv(arch, "fp8", 4, mtp=True)
    assert (k.latent_layers, k.indexer_layers, k.latent_per_layer) == (79, 79, 656)
    assert k.rank_bytes == 79 * (656 + 132) / 4 == 15_563
    # The rig arithmetic: 202,752 tokens x 78 layers x 656 B per rank at DCP 1
    assert kv(arch, "fp8", 1, False).latent_per_layer * 78 * 202_752 / GIB == pytest.approx(9.66, abs=0.01)


def test_small_hand_computed_blocks():
    arch = read_arch(glm5_config(kv_lora_rank=256, qk_rope_head_dim=32, index_head_dim=64, num_hidden_layers=4))
    assert indexer_bytes(arch) == 64 + 4 * (64 // 128)  # the engine's floor: no whole 128-value scale block
    k = kv(arch, "bf16", 2, mtp=False)
    assert k.all_ranks_bytes == 4 * (576 + 64) and k.rank_bytes == 4 * (576 + 64) / 2
    # blocks of 64 tokens per rank (128 of a sequence at DCP 2), all layers' pages together; one null block
    assert k.block_bytes == 64 * k.all_ranks_bytes and k.block_tokens == 128
    assert k.tokens(10 * k.block_bytes + 5) == 9 * 128
    assert k.tokens(-5) == 0 and k.tokens(k.block_bytes) == 0
    assert k.bytes_for(129) == (2 + 1) * k.block_bytes  # 65 tokens per rank: 2 blocks, and the null block
    assert k.engine_needs(129) == 2 * k.block_bytes


def test_indexer_schedule_glm53_and_frequency():
    types = ["full", "shared", "shared", "shared"] * 3
    arch = read_arch(glm5_config(num_hidden_layers=12, indexer_types=types))
    k = kv(arch, "bf16", 1, mtp=False, engine=UPSTREAM)
    assert (k.latent_layers, k.indexer_layers) == (12, 3)
    assert k.all_ranks_bytes == 12 * 1152 + 3 * 132
    assert kv(arch, "bf16", 1, mtp=False).indexer_layers == 12  # the fork keeps the cache on every layer
    # compute_skip_topk_layers: a layer keeps its top-k when max(layer - offset + 1, 0) % freq == 0
    for n, freq, offset in ((78, 4, 3), (78, 4, 2), (10, 4, 0), (10, 3, 5), (5, 4, 9), (78, 1, 2)):
        a = read_arch(glm5_config(num_hidden_layers=n, index_topk_freq=freq, index_skip_topk_offset=offset))
        by_loop = sum(max(layer - offset + 1, 0) % freq == 0 for layer in range(n))
        assert kv(a, "bf16", 1, False, engine=UPSTREAM).indexer_layers == by_loop, (n, freq, offset)
    glm53 = read_arch(glm5_config(index_topk_freq=4, index_skip_topk_offset=3))
    assert kv(glm53, "bf16", 1, False, engine=UPSTREAM).indexer_layers == 21  # not 20
    assert kv(glm53, "bf16", 1, True, engine=UPSTREAM).indexer_layers == 21 + 1  # + the MTP layer's own
    no_indexer = {k: v for k, v in glm5_config().items() if not k.startswith("index_")}
    assert kv(read_arch(no_indexer), "bf16", 1, False).all_ranks_bytes == 78 * 1152


def test_config_errors_are_named():
    with pytest.raises(CheckFailed, match="kv_lora_rank is missing"):
        read_arch({k: v for k, v in glm5_config().items() if k != "kv_lora_rank"})
    with pytest.raises(CheckFailed, match="model_type 'llama'"):
        read_arch(glm5_config(model_type="llama"))
    with pytest.raises(CheckFailed, match="qk_rope_head_dim is '64'"):
        read_arch(glm5_config(qk_rope_head_dim="64"))


# ---- sharding ------------------------------------------------------------------------------------------

def test_slice_bytes_per_style():
    w = 4096 * 1024 * 2  # bf16 [4096, 1024]
    assert slice_bytes("x.q_b_proj.weight", (4096, 1024), w, COLUMN, 4) == w // 4
    assert slice_bytes("x.o_proj.weight", (4096, 1024), w, ROW, 4) == w // 4
    assert slice_bytes("x.q_a_proj.weight", (4096, 1024), w, REPLICATED, 4) == w
    # vocab: 1000 rows padded to 1024, 256 per rank
    assert slice_bytes("model.embed_tokens.weight", (1000, 64), 1000 * 128, VOCAB, 4) == 256 * 128
    # EXL3 linear [in/16, out/16, 16K]: column splits out (dim 1) and svh; row splits in (dim 0) and suh
    t = 64 * 256 * 64 * 2
    assert slice_bytes("a.kv_b_proj.trellis", (64, 256, 64), t, COLUMN, 4) == t // 4
    assert slice_bytes("a.kv_b_proj.suh", (1024,), 2048, COLUMN, 4) == 2048
    assert slice_bytes("a.kv_b_proj.svh", (4096,), 8192, COLUMN, 4) == 2048
    assert slice_bytes("a.o_proj.suh", (4096,), 8192, ROW, 4) == 2048
    assert slice_bytes("a.o_proj.svh", (1024,), 2048, ROW, 4) == 2048
    assert slice_bytes("a.o_proj.mcg", (), 4, ROW, 4) == 4


def test_non_expert_tensors_placed_by_the_vllm_table(tmp_path):
    """Attention, indexer, embeddings and a norm in their own shard: each rank's bytes by hand."""
    root = write_checkpoint(tmp_path / "c", tiny_experts_only())
    h = 256
    tensors = {
        "model.layers.3.self_attn.q_a_proj.weight": torch.randn(128, h, dtype=torch.bfloat16),  # replicated
        "model.layers.3.self_attn.q_b_proj.weight": torch.randn(4 * 48, 128, dtype=torch.bfloat16),  # column
        "model.layers.3.self_attn.o_proj.weight": torch.randn(h, 4 * 32, dtype=torch.bfloat16),  # row
        "model.layers.3.self_attn.indexer.wk.weight": torch.randn(128, h, dtype=torch.bfloat16),  # replicated
        "model.embed_tokens.weight": torch.randn(500, h, dtype=torch.bfloat16),  # vocab: 512 rows, 256 per rank
        "model.layers.3.input_layernorm.weight": torch.randn(h, dtype=torch.bfloat16),
    }
    save_file(tensors, str(root / "model-extra.safetensors"))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(tensors, "model-extra.safetensors"))
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    result = fit(open_checkpoint(open_source(str(root))), FitRequest(tp=2, gpu=PRESETS["h100"], ctx=1024))
    parts = result.ranks[1].weights.parts
    assert parts["attention"] == 128 * h * 2 + 192 * 128 * 2 // 2 + h * 128 * 2 // 2
    assert parts["indexer"] == 128 * h * 2 and parts["norms"] == h * 2
    assert parts["embeddings"] == 256 * h * 2
    absent = result.ranks[1].weights.absent
    assert "attention" not in absent and "embeddings" not in absent and "lm_head" in absent


# ---- weights per rank = the rank's tensor bytes ----------------------------------------------------------

def tr3_rank_bytes(root: Path, tp: int, decoder_layers: int | None = None) -> list[int]:
    """Sum of each rank's tensor bytes from the raw headers (layers below `decoder_layers` when given)."""
    out = [0] * tp
    for shard in sorted(root.glob("*.safetensors")):
        for name, entry in header(shard).items():
            layer = int(name.split(".")[2])
            if decoder_layers is not None and layer >= decoder_layers:
                continue
            out[int(RANK.search(name).group(1))] += nbytes(entry)
    return out


def exl3v1_rank_bytes(root: Path, tp: int) -> int:
    """One rank's bytes: its share of the slot rows of codes, rotations and rate tables, all other tensors."""
    total = 0
    for shard in sorted(root.glob("exl3-layer-*.safetensors")):
        for name, entry in header(shard).items():
            total += nbytes(entry) // tp if name in ("codes", "rotations", "rates_fc1", "rates_fc2") else nbytes(entry)
    return total


def check_tr3(root: Path, tp: int, source=None, **request) -> None:
    ckpt = open_checkpoint(source or open_source(str(root)))
    arch_layers = json.loads((root / "config.json").read_text())["num_hidden_layers"]
    for mtp in (False, True):
        result = fit(ckpt, FitRequest(tp=tp, gpu=PRESETS["h200"], mtp=mtp, allow_long_context=True, **request))
        expected = tr3_rank_bytes(root, tp, None if mtp else arch_layers)
        assert [r.weight_bytes for r in result.ranks] == expected
        doc = result.to_json()
        assert [r["stored_weight_bytes"] for r in doc["ranks"]] == expected


def test_tiny_weight_bytes_per_rank_equal_the_rank_tensor_bytes(tmp_path):
    spec = dataclasses.replace(tiny_experts_only(), layers=(3, 4, 5), num_hidden_layers=5, mtp_layers=1)
    check_tr3(write_checkpoint(tmp_path / "t", spec), 2, ctx=1024)
    shared = dataclasses.replace(spec, rotation_layout="shared_h_v1")
    check_tr3(write_checkpoint(tmp_path / "s", shared), 2, ctx=1024)


def test_tiny_exl3v1_weight_bytes(tmp_path):
    root = write_exl3v1_checkpoint(tmp_path / "v", tiny_experts_only())
    result = fit(open_checkpoint(open_source(str(root))), FitRequest(tp=1, gpu=PRESETS["h100"], ctx=1024))
    assert result.ranks[0].weight_bytes == exl3v1_rank_bytes(root, 1)
    tiers = result.ranks[0].weights.tiers
    assert {k: t.experts for k, t in tiers.items() if k is not None} == {3: 2 * 6, 4: 2 * 2}


@pytest.mark.slow
def test_glm52_tp4_sparse_and_exl3v1(glm52_tp4_sparse, tmp_path, capsys):
    root = glm52_tp4_sparse
    check_tr3(root, 4, ctx=131072)
    code, out, _ = run_cli(capsys, "fit", str(root), "--tp", "4", "--gpu", "rtx-pro-6000", "--kv-dtype", "fp8", "--ctx", "131072",
                           "--json")
    doc = json.loads(out)
    assert code == {"fits": 0, "marginal": 5, "does not fit": 1}[doc["verdict"]]
    assert [r["stored_weight_bytes"] for r in doc["ranks"]] == tr3_rank_bytes(root, 4, 78)
    v1 = tmp_path / "glm-v1"
    assert run_cli(capsys, "synth", str(v1), "--preset", "glm52-tp4", "--sparse", "--format", "exl3-v1",
                   "--json")[0] == 0
    code, out, _ = run_cli(capsys, "fit", str(v1), "--tp", "4", "--gpu", "rtx-pro-6000", "--kv-dtype", "fp8", "--ctx", "131072",
                           "--json", "--mtp")
    doc = json.loads(out)
    assert [r["stored_weight_bytes"] for r in doc["ranks"]] == [exl3v1_rank_bytes(v1, 4)] * 4
    k_experts = {t["k"]: t["experts"] for t in doc["ranks"][0]["tiers"] if t["k"] is not None}
    assert k_experts == {3: 192 * 75, 4: 64 * 75}  # decoder MoE layers 3-77 (the MTP layer 78 apart)


def test_from_the_loopback_hub_without_downloading_a_shard(tmp_path, capsys):
    spec = dataclasses.replace(tiny_experts_only(), layers=(3, 4, 5), num_hidden_layers=5, mtp_layers=1)
    served = write_checkpoint(tmp_path / "served", spec)
    served_v1 = write_exl3v1_checkpoint(tmp_path / "served-v1", tiny_experts_only())
    with HubServer() as hub:
        hub.add_commit("org/tiny", served)
        hub.add_commit("org/tiny-v1", served_v1)
        source = open_source("org/tiny", endpoint=hub.endpoint, cache_dir=tmp_path / "cache")
        check_tr3(served, 2, source=source, ctx=1024)
        code, out, _ = run_cli(capsys, "fit", "org/tiny-v1", "--endpoint", hub.endpoint, "--cache-dir",
                               str(tmp_path / "cache"), "--tp", "1", "--gpu", "h100", "--ctx", "1024", "--json")
        assert code == 0 and json.loads(out)["ranks"][0]["stored_weight_bytes"] == exl3v1_rank_bytes(served_v1, 1)
        assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0  # headers only: tensor data only within their reads
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


@pytest.mark.slow
def test_glm52_tp4_sparse_from_the_loopback_hub_reads_headers_only(glm52_tp4_sparse, tmp_path, capsys):
    """The production-shape checkpoint served in place from disk: the same per-rank bytes as the local fit,
    for a tiny fraction of the files' bytes and no tensor data."""
    root = glm52_tp4_sparse
    shards = sorted(root.glob("*.safetensors"))
    # Declared LFS hashes: hashing ~300 GB of holes would be the whole test; the client checks sha256 only
    # on a whole-file download, and a shard downloaded whole would fail that check.
    declared = {p.name: hashlib.sha256(f"declared {p.name}".encode()).hexdigest() for p in shards}
    args = ("--tp", "4", "--gpu", "rtx-pro-6000", "--kv-dtype", "fp8", "--ctx", "131072", "--mtp", "--json")
    code, out, _ = run_cli(capsys, "fit", str(root), *args)
    local = json.loads(out)
    assert code in (0, 1, 5)
    with HubServer() as hub:
        hub.add_commit("org/glm52", root, in_place=True, lfs_sha256=declared)
        code_hub, out, err = run_cli(capsys, "fit", "org/glm52", "--endpoint", hub.endpoint, "--cache-dir",
                                     str(tmp_path / "cache"), *args)
        served = sum(hub.bytes_served.values())
        tensor_bytes = hub.tensor_bytes_past_window(HEADER_WINDOW)
    remote = json.loads(out)
    assert code_hub == code, err
    expected = tr3_rank_bytes(root, 4)  # with --mtp every stored tensor counts
    assert [r["stored_weight_bytes"] for r in remote["ranks"]] == [r["stored_weight_bytes"] for r in local["ranks"]] \
        == expected
    assert remote["ranks"] == local["ranks"] and remote["fits"] == local["fits"]
    total = sum(p.stat().st_size for p in shards)
    assert total > 250 * 10**9 and sum(expected) == sum(nbytes(e) for p in shards for e in header(p).values())
    assert tensor_bytes == 0 and served < total // 1000  # headers and the index only
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


# ---- reserve, budget, remedies -------------------------------------------------------------------------

def test_reserve_terms_are_named_and_banded():
    arch = read_arch(glm5_config())
    terms = {t.name: t for t in reserve_terms(arch, ENGINES[FORK], 4, 1, 1024, 8192, 131072, False)}
    assert set(terms) == {"CUDA context and library handles", "NCCL communicators", "MLA W_UK_T / W_UV",
                          "DSA top-k indices buffer", "DSA indexer workspace", "activation peak",
                          "EXL3 MoE prefill arena", "CUDA graph pools", "memory outside torch after the snapshot"}
    assert "mixed-K kernel workspace" not in terms  # trellis's own kernel does not run in a vLLM serve
    # exact terms from the sources: 16 heads x (192 x 512 + 512 x 256) bf16 x 78 layers = 546 MiB at TP 4
    assert terms["MLA W_UK_T / W_UV"].typical == 78 * 16 * (192 * 512 + 512 * 256) * 2 == 546 * (1 << 20)
    assert terms["DSA top-k indices buffer"].typical == 8192 * 2048 * 4 == 64 * (1 << 20)
    # the indexer workspace grows with the context: 40 x ctx x 132 B, and the fork's fixed 512 MiB
    assert terms["DSA indexer workspace"].typical == 131072 * 40 * 132 + 512 * (1 << 20)
    up = {t.name: t for t in reserve_terms(arch, ENGINES[UPSTREAM], 4, 1, 1024, 8192, 202752, False)}
    assert up["DSA indexer workspace"].typical == 202752 * 40 * 132
    assert "EXL3 MoE prefill arena" not in up and "activation peak, held free with its margin" in up
    for t in terms.values():
        assert t.low <= t.typical <= t.high and (t.measured or t.low == t.high)
    assert terms["CUDA context and library handles"].outside and terms["NCCL communicators"].outside
    single = {t.name for t in reserve_terms(arch, ENGINES[FORK], 1, 1, 256, 8192, 4096, False)}
    assert "NCCL communicators" not in single


def _tiny(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "t", tiny_experts_only())


def test_budget_arithmetic(tmp_path):
    ckpt = open_checkpoint(open_source(str(_tiny(tmp_path))))
    request = FitRequest(tp=2, gpu=gpu(8), ctx=4096, kv_dtype="bf16", gpu_memory_utilization=0.5)
    result = fit(ckpt, request)
    b = result.ranks[0]
    reserve = sum(t.typical for t in result.reserve if not t.outside)
    assert b.usable_bytes == math.ceil(8 * GIB * 0.5)  # request_memory: ceil(total x utilization)
    assert b.kv_budget_bytes == b.usable_bytes - b.weight_bytes - b.absent_bytes - reserve
    per_token = 5 * (160 + 132)  # tiny: 5 layers of (64 + 16) x 2 B latent + 132 B indexer
    assert result.kv.rank_bytes == per_token
    assert b.kv_tokens == (b.kv_budget_bytes // (64 * per_token) - 1) * 64  # whole blocks, less the null block
    assert result.verdict == "fits" and result.longest_context == result.pool_tokens // result.request.seqs
    assert result.concurrent_requests == min(result.request.seqs, result.pool_tokens // 64 // 64)


def test_remedies_with_their_numbers(tmp_path):
    """Every remedy offered, applied, fits over the whole band; its numbers are that fit's; it is spelled with
    its values. A deep model (400 layers of tiny's latent) makes the KV cache the bulk of the budget."""
    spec = dataclasses.replace(preset("tiny"), num_hidden_layers=400)
    ckpt = open_checkpoint(open_source(str(write_checkpoint(tmp_path / "deep", spec))))
    request = FitRequest(tp=2, gpu=gpu(28, "sm_100"), ctx=120_000, gpu_memory_utilization=0.5, allow_long_context=True)
    result = fit(ckpt, request)
    assert result.verdict == "does not fit"
    kinds = {m.kind: m for m in result.remedies}
    assert {"kv-dtype", "dcp", "utilization"} <= set(kinds), kinds
    assert kinds["kv-dtype"].change == "--kv-dtype fp8" and kinds["dcp"].change == "--dcp 2"
    for remedy in result.remedies:
        if remedy.kind == "demote":
            continue
        assert "N" not in remedy.change.split() and remedy.changes
        applied = fit(ckpt, dataclasses.replace(request, **remedy.changes))
        assert applied.verdict == "fits", (remedy, applied.band)
        assert remedy.numbers["kv_tokens"] == applied.band["high"].pool_tokens
    # where no single change fits, the smallest combination that does, every option with its value
    tight = dataclasses.replace(request, gpu=gpu(18, "sm_100"))
    combined = [m for m in fit(ckpt, tight).remedies if m.kind == "combined"]
    assert combined and combined[0].change.startswith("--dcp 2 --kv-dtype fp8")
    assert fit(ckpt, dataclasses.replace(tight, **combined[0].changes)).verdict == "fits"


def test_demotion_remedy_uses_the_measured_tier_sizes(tmp_path):
    spec = dataclasses.replace(tiny_experts_only(), experts=64, partition=(32, 32), top_k=2)
    root = write_checkpoint(tmp_path / "d", spec)
    ckpt = open_checkpoint(open_source(str(root)))
    # bytes of one expert-layer on rank 0 at each K, from the raw headers
    per_k: dict[int, list[int]] = {3: [], 4: []}
    for shard in sorted(root.glob("*.safetensors")):
        experts: dict[str, int] = {}
        ks: dict[str, int] = {}
        for name, entry in header(shard).items():
            if ".rank0." in name:
                key = name.split(".rank0.")[0].rsplit(".", 1)[0]
                experts[key] = experts.get(key, 0) + nbytes(entry)
                if name.endswith("gate_proj.rank0.trellis"):
                    ks[key] = entry["shape"][2] // 16
        for key, b in experts.items():
            per_k[ks[key]].append(b)
    saving = sum(per_k[4]) // len(per_k[4]) - -(-sum(per_k[3]) // len(per_k[3]))
    base = fit(ckpt, FitRequest(tp=2, gpu=gpu(8), ctx=1024, gpu_memory_utilization=0.5))
    high = base.band["high"].ranks[0]
    weights = high.weight_bytes + high.absent_bytes + high.reserve_bytes
    # A GPU whose budget misses the context's KV by about 10 expert-layers' saving at the expensive end of the
    # band: half of it requested, the CUDA context in the other half
    total = 2 * (weights + base.kv.bytes_for(1024) - 10 * saving + 100)
    result = fit(ckpt, FitRequest(tp=2, gpu=Gpu("x", "x", total, "sm_90"), ctx=1024, gpu_memory_utilization=0.5))
    short = result.band["high"].ranks[0].short_bytes
    assert result.verdict == "marginal" and result.short_by_bytes == short and 9 * saving < short <= 10 * saving
    demote = next(m for m in result.remedies if m.kind == "demote")
    assert demote.numbers["experts"] == 10 and demote.numbers["bytes_saved_per_expert"] == saving
    assert (demote.numbers["from_k"], demote.numbers["to_k"]) == (4, 3)


# ---- the CLI -------------------------------------------------------------------------------------------

def test_cli_exit_codes_and_json_keys(tmp_path, capsys):
    root = str(_tiny(tmp_path))
    code, out, _ = run_cli(capsys, "fit", root, "--tp", "2", "--gpu", "h200", "--ctx", "2048", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["fits"] is True
    for key in ("tp", "dcp", "kv_dtype", "ctx", "kv_bytes_per_token", "ranks", "fits", "remedies"):
        assert key in doc
    assert set(doc["ranks"][0]) >= {"rank", "expert_bytes", "weight_bytes", "reserve_bytes", "kv_budget_bytes",
                                    "kv_tokens"}
    code, out, _ = run_cli(capsys, "fit", root, "--tp", "2", "--gpu-mem", "1GiB", "--arch", "sm_90", "--ctx", "2048")
    assert code == 1 and "does not fit: short by" in out
    assert out.count("\n") <= 40  # one screen
    for args in (["--tp", "2", "--dcp", "3", "--gpu", "h100"], ["--gpu", "h100"], ["--tp", "2", "--gpu", "a100"],
                 ["--tp", "2", "--gpu", "h100", "--gpu-mem", "80GB"], ["--tp", "2", "--gpu-mem", "lots"],
                 ["--tp", "2", "--gpu", "h100", "--gpu-memory-utilization", "1.5"],
                 ["--tp", "0", "--gpu", "h100"], ["--tp", "2", "--gpu-mem", "80GiB"]):
        code, out, err = run_cli(capsys, "fit", root, *args)
        assert code == 2, (args, out, err)
        assert "Traceback" not in err
    code, _, err = run_cli(capsys, "fit", str(tmp_path / "missing"), "--tp", "2", "--gpu", "h100")
    assert code == 3


def test_cli_text_report_one_table_for_equal_ranks(tmp_path, capsys):
    code, out, _ = run_cli(capsys, "fit", str(_tiny(tmp_path)), "--tp", "2", "--gpu", "H100", "--ctx", "4096")
    assert code == 0
    assert "ranks 0-1" in out and "rank 0 " not in out
    assert "reserve: EXL3 MoE prefill arena" in out and "fits:" in out
    assert "engine: vLLM fork (local-inference-lab) at 28be48fa9" in out


def test_sizes():
    assert parse_size("96GiB") == 96 * GIB and parse_size("80GB") == 80 * 10**9 and parse_size("1024B") == 1024
    assert parse_size("1.5GiB") == 3 * GIB // 2
    for bad in ("96", "0", "96 parsecs", "9" * 400 + "GiB", "2000TiB"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_inspect_has_the_fit_section_when_tp_and_a_gpu_are_given(tmp_path, capsys):
    root = str(_tiny(tmp_path))
    code, out, _ = run_cli(capsys, "inspect", root, "--tp", "2", "--gpu", "h100", "--ctx", "2048", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["fit"]["tp"] == 2 and doc["fit"]["fits"] is True
    direct = json.loads(run_cli(capsys, "fit", root, "--tp", "2", "--gpu", "h100", "--ctx", "2048", "--json")[1])
    assert doc["fit"]["ranks"] == direct["ranks"]
    code, out, _ = run_cli(capsys, "inspect", root, "--tp", "2", "--gpu-mem", "80GB", "--arch", "sm_90")
    assert code == 0 and "KV tokens" in out
    assert run_cli(capsys, "inspect", root, "--gpu", "h100")[0] == 2  # a fit section needs the TP
    alone = json.loads(run_cli(capsys, "inspect", root, "--tp", "2", "--json")[1])  # the server TP's view only
    assert "fit" not in alone and alone["serve_tp"]["tp"] == 2
    assert "fit" not in json.loads(run_cli(capsys, "inspect", root, "--json")[1])


def test_plain_exl3_experts_are_cut_as_the_loaders_cut_them(tmp_path):
    root = to_plain_exl3(write_checkpoint(tmp_path / "p", dataclasses.replace(tiny_experts_only(), tp=1)))
    expected = 0
    for shard in sorted(root.glob("*.safetensors")):
        for name, entry in header(shard).items():
            proj, field = name.split(".")[-2:]
            # trellis always; the output-side svh of gate/up and the input-side suh of down; markers whole
            split = field == "trellis" or field in ("suh", "svh") and (field == "svh") == (proj != "down_proj")
            expected += nbytes(entry) // 2 if split else nbytes(entry)
    result = fit(open_checkpoint(open_source(str(root))), FitRequest(tp=2, gpu=PRESETS["h100"], ctx=1024))
    assert [r.weight_bytes for r in result.ranks] == [expected, expected]


def test_r7_rank_segments(tmp_path):
    root = to_r7(write_checkpoint(tmp_path / "r", tiny_experts_only()))
    check_tr3(root, 2, ctx=1024)


def test_refusals_the_engine_would_make_and_configs_without_mla(tmp_path, capsys):
    root = str(_tiny(tmp_path))
    code, _, err = run_cli(capsys, "fit", root, "--tp", "8", "--gpu", "h100")
    assert code == 2 and "attention heads" in err
    code, _, err = run_cli(capsys, "fit", "--tp", "2", "--gpu", "h100")  # no SOURCE: never the bundled sample
    assert code == 2 and "SOURCE is required" in err and "Traceback" not in err
    synthetic = write_checkpoint(tmp_path / "synthetic", dataclasses.replace(tiny_experts_only(), model=None))
    code, _, err = run_cli(capsys, "fit", str(synthetic), "--tp", "2", "--gpu", "h100")  # no MLA fields
    assert code == 1 and "config.json: model_type 'trellis_synth_moe'" in err and "Traceback" not in err


def test_an_absurd_layer_count_is_arithmetic_not_a_loop():
    arch = read_arch(glm5_config(num_hidden_layers=10**12, index_topk_freq=4, index_skip_topk_offset=0))
    k = kv(arch, "bf16", 1, mtp=False, engine=UPSTREAM)
    assert (k.latent_layers, k.indexer_layers) == (10**12, 10**12 // 4)  # layers 3, 7, 11, ...
    assert kv(arch, "bf16", 1, mtp=False).indexer_layers == 10**12


@pytest.mark.skipif(torch.cuda.is_available(), reason="a visible GPU is the default")
def test_no_gpu_given_and_none_visible_is_a_usage_error(tmp_path, capsys):
    code, _, err = run_cli(capsys, "fit", str(_tiny(tmp_path)), "--tp", "2")
    assert code == 2 and "no GPU visible here" in err


def test_routed_experts_per_rank_is_one_quantity_in_inspect_and_fit(tmp_path, capsys):
    """One definition (the decoder's MoE layers, the MTP layer apart) and one unit (GiB) in both commands."""
    spec = dataclasses.replace(preset("tiny"), layers=(3, 4, 5), num_hidden_layers=5, mtp_layers=1)
    root = str(write_checkpoint(tmp_path / "m", spec))
    inspected = json.loads(run_cli(capsys, "inspect", root, "--json")[1])["totals"]
    fitted = json.loads(run_cli(capsys, "fit", root, "--tp", "2", "--gpu", "h100", "--ctx", "1024", "--json")[1])
    per_rank = max(r["parts"]["routed experts"] for r in fitted["ranks"])
    assert inspected["routed_bytes_per_rank"] == per_rank and inspected["mtp_routed_bytes_per_rank"] > 0
    text = run_cli(capsys, "inspect", root)[1]
    assert f"routed experts per rank: {per_rank / GIB:.2f} GiB" in text and "the MTP layer's" in text
