"""fit's KV arithmetic against the engine's: hand-computed cases from the cited sources (run everywhere), and a
differential test on the grid TP 4/8 x DCP 1/2/4 x every dtype x sm_90/sm_100/sm_120 x ctx 32k/131072/202752 x
utilization 0.9/0.95 against vLLM 0.34.0's own spec classes (`vllm/v1/kv_cache_interface.py`), imported in a
subprocess from a `pip install --no-deps --target` directory (skipped when that directory is absent).

The engine's constants that live in modules this CPU cannot import (the fp8_ds_mla row, the nvfp4_ds_mla row)
are read from the engine's own source text, never typed here.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_cli
from trellis_cli.fit.arch import read_arch
from trellis_cli.fit.engines import (ENGINES, FORK, FORK_B12X, SM90, SM100, SM120, UPSTREAM, EngineRefusal,
                                     indexer_cache_layers, resolve_layout)
from trellis_cli.fit.kv import kv_per_token
from trellis_cli.synth import GLM_MOE_DSA, preset, write_checkpoint

GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def glm5(**changes) -> dict:
    return {"model_type": "glm_moe_dsa", "hidden_size": 6144, "num_hidden_layers": 78, "num_nextn_predict_layers": 1,
            "first_k_dense_replace": 3, "moe_intermediate_size": 2048, "n_routed_experts": 256,
            "num_experts_per_tok": 8, **GLM_MOE_DSA, **changes}


ARCH = read_arch(glm5())


def layout(engine: str, family: str, asked: str, dcp: int = 1, tp: int = 4, fp8_rope: bool = False):
    return resolve_layout(ENGINES[engine], family, asked, dcp, 64 // tp, 512, 64, fp8_rope)


# ---- hand-computed, each from the file and function named ------------------------------------------------

def test_stored_layout_per_family_and_version():
    # vLLM 0.34.0: mla_attention.py _canonicalize_sparse_mla_kv_cache_dtype turns a quantized cache on
    # FLASHMLA_SPARSE (sm_90) and auto/fp8 on FLASHINFER_MLA_SPARSE_SM120 into fp8_ds_mla: 512 fp8 + 4 fp32 scales
    # + 64 bf16 = 656 B (flashmla_sparse.py's layout note; backend.py: get_fp8_ds_mla_row_bytes)
    expected = {
        (UPSTREAM, SM90, "auto"): ("bf16", 1152), (UPSTREAM, SM90, "fp8"): ("fp8_ds_mla", 656),
        (UPSTREAM, SM90, "fp8_ds_mla"): ("fp8_ds_mla", 656), (UPSTREAM, SM90, "bf16"): ("bf16", 1152),
        # models/config.py GlmMoeDsaForCausalLM.verify_and_update_config: auto -> fp8_e4m3 on SM10x, 576 B
        (UPSTREAM, SM100, "auto"): ("fp8_e4m3", 576), (UPSTREAM, SM100, "fp8"): ("fp8_e4m3", 576),
        (UPSTREAM, SM100, "bf16"): ("bf16", 1152), (UPSTREAM, SM100, "fp8_ds_mla"): ("fp8_ds_mla", 656),
        # flashmla_sparse.py: 256 B e2m1 + 64 B e4m3 RoPE + 32 B scales
        (UPSTREAM, SM100, "nvfp4_ds_mla"): ("nvfp4_ds_mla", 352),
        (UPSTREAM, SM120, "auto"): ("fp8_ds_mla", 656), (UPSTREAM, SM120, "fp8"): ("fp8_ds_mla", 656),
        # the fork keeps bf16 on sm_100; stores fp8 as fp8_ds_mla on sm_90 and sm_120
        (FORK, SM100, "auto"): ("bf16", 1152), (FORK, SM90, "fp8"): ("fp8_ds_mla", 656),
        (FORK, SM120, "fp8"): ("fp8_ds_mla", 656),
        # b12x_mla_sparse.py: the nvfp4_ds_mla record, 432 B, 368 B with KV_FP8_ROPE=1
        (FORK_B12X, SM120, "nvfp4_ds_mla"): ("nvfp4_ds_mla", 432),
    }
    for (engine, family, asked), (stored, nbytes) in expected.items():
        got = layout(engine, family, asked)
        assert (got.stored, got.latent_bytes) == (stored, nbytes), (engine, family, asked)
        assert got.source
    assert layout(FORK_B12X, SM120, "nvfp4_ds_mla", fp8_rope=True).latent_bytes == 368


@pytest.mark.parametrize(("engine", "family", "asked", "dcp", "tp", "words"), [
    (UPSTREAM, SM90, "nvfp4_ds_mla", 1, 4, "SM100 only"),  # FLASHMLA_SPARSE.supports_combination
    (UPSTREAM, SM120, "nvfp4_ds_mla", 1, 4, "SM100 only"),
    (UPSTREAM, SM100, "nvfp4_ds_mla", 2, 4, "validate_nvfp4_kv_cache_with_mla"),  # config/vllm.py
    (UPSTREAM, SM120, "fp8", 2, 4, "DCP not"),  # FlashInferMLASparseSM120Impl: supports_dcp False
    (UPSTREAM, SM120, "bf16", 1, 4, "takes no bf16"),
    (UPSTREAM, SM90, "fp8", 2, 2, "mixed-batch"),  # 32 heads per rank: flashmla_sparse.py's separate path
    (FORK, SM120, "auto", 1, 4, "no sparse MLA backend stores a bf16"),
    (FORK, SM90, "nvfp4_ds_mla", 1, 4, "not a cache dtype"),
    (FORK_B12X, SM100, "nvfp4_ds_mla", 1, 4, "not a cache dtype"),
])
def test_refusals_name_the_engine_and_a_remedy(engine, family, asked, dcp, tp, words):
    with pytest.raises(EngineRefusal) as caught:
        layout(engine, family, asked, dcp, tp)
    message = str(caught.value)
    assert words in message and ENGINES[engine].label in message and family in message
    assert caught.value.remedy and "remedy:" in message


def test_the_issue_example_dcp2_fp8_on_sm120():
    """fp8 on sm_120 is stored as fp8_ds_mla: 78 x (656 + 132) / 2 = 30,732 B per token per rank (not 27,612);
    on the budget that held 142,976 tokens at 576 B the engine's estimate is 128,384 (1,003 blocks of 128
    tokens: kv_cache_planning.py estimate_max_model_len over FullAttentionSpec.max_memory_usage_bytes), and it
    refuses a 131,072-token context (_check_enough_kv_cache_memory)."""
    for engine in (FORK, UPSTREAM):
        kv = kv_per_token(ARCH, layout(engine, SM120, "fp8", 2 if engine == FORK else 1), 2, False, ENGINES[FORK])
        assert kv.rank_bytes == 30_732
    kv = kv_per_token(ARCH, layout(FORK, SM120, "fp8", 2), 2, False, ENGINES[FORK])
    budget = 142_976 * 27_612  # the budget the old 576 B answer spent
    assert kv.estimated_max_len(budget) == 128_384
    assert kv.engine_needs(131_072) > budget and kv.bytes_for(131_072) > budget
    assert kv.tokens(budget) == (budget // (64 * 78 * 788) - 1) * 128  # less the null block


def test_indexer_layers_per_version():
    glm53 = read_arch(glm5(index_topk_freq=4, index_skip_topk_offset=3))
    # compute_skip_topk_layers (model_executor/models/utils.py): layers 0-2, then 6, 10, ..., 74
    assert indexer_cache_layers(glm53, ENGINES[UPSTREAM]) == 21
    assert indexer_cache_layers(glm53, ENGINES[FORK]) == 78  # the fork keeps the cache on every layer


def test_granules_of_the_extensible_cache():
    """extensible_kv_cache.py ExtensibleKVCache.physical_bytes_for: each layer segment in whole 2 MiB
    granules; a budget just short of the granule-rounded size holds one block fewer."""
    kv = kv_per_token(ARCH, layout(UPSTREAM, SM90, "fp8"), 1, False, ENGINES[UPSTREAM])
    assert kv.granular and kv.latent_layers == 78 and kv.indexer_layers == 78
    def mapped(blocks: int) -> int:
        granule = 2 << 20
        return 78 * (-(-blocks * 64 * 656 // granule) * granule) + 78 * (-(-blocks * 64 * 132 // granule) * granule)

    for budget in (mapped(1000), mapped(1000) - 1, 1000 * kv.block_bytes, 5 * GIB + 12345):
        by_search = max(n for n in range(0, 3000) if mapped(n) <= budget)
        assert kv.blocks(budget) == by_search, budget
    assert kv.blocks(1000 * kv.block_bytes) < 1000  # the ungranular arithmetic would overstate it


# ---- the CLI: engine versions, families, inputs in users' words --------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_checkpoint(tmp_path_factory.mktemp("tiny") / "t", preset("tiny")))


def test_cli_names_the_engine_version_and_refuses_what_it_refuses(tiny, capsys):
    code, out, _ = run_cli(capsys, "fit", tiny, "--tp", "2", "--gpu", "h100", "--ctx", "2048", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["engine"] == FORK and doc["engine_label"].startswith("vLLM fork")
    assert doc["kv_layout"]["stored"] == "bf16" and doc["gpu_family"] == SM90
    assert doc["max_num_seqs"] == 1024 and doc["gpu_memory_utilization"] == 0.92  # the fork on an 80 GB card
    # vLLM 0.34 has no exl3 quantization method: it refuses an EXL3 checkpoint, by name, with the remedy
    code, _, err = run_cli(capsys, "fit", tiny, "--tp", "2", "--gpu", "h100", "--engine", "vllm-0.34")
    assert code == 1 and "vLLM 0.34.0 has no exl3 quantization method" in err and "--engine vllm-fork" in err
    code, _, err = run_cli(capsys, "fit", tiny, "--tp", "2", "--gpu", "h100", "--kv-dtype", "nvfp4_ds_mla")
    assert code == 1 and "remedy: --kv-dtype fp8" in err and "Traceback" not in err


def test_cli_inputs_in_users_words(tiny, capsys):
    def fit(*args):
        return run_cli(capsys, "fit", tiny, "--tp", "2", *args)

    code, _, err = fit("--gpu-mem", "96")
    assert code == 2 and "96 has no unit" in err and "96GiB" in err
    code, _, err = fit("--gpu-mem", "96GB")
    assert code == 2 and "which GPU family" in err and "--arch sm_90" in err and "sm_120" in err
    code, out, _ = fit("--gpu-mem", "96GB", "--arch", "sm_90", "--ctx", "2048")
    assert code == 0 and "96GB read as 96,000,000,000 B = 89.41 GiB (decimal" in out and "--gpu-mem" not in out.split("\n")[0][:30]
    for spelled in ("H100", "h100", "H100 SXM"):
        assert fit("--gpu", spelled, "--ctx", "2048")[0] == 0
    for vllm_spelling, ours in (("bfloat16", "bf16"), ("fp8_e4m3", "fp8")):
        code, out, _ = fit("--gpu", "b200", "--ctx", "2048", "--kv-dtype", vllm_spelling, "--json")
        assert code == 0 and json.loads(out)["kv_dtype"] == ours
    code, out, _ = fit("--gpu", "h100", "--ctx", "2k", "--json")
    assert code == 0 and json.loads(out)["ctx"] == 2000  # vLLM's human_readable_int: k = 10^3, K = 2^10
    assert json.loads(fit("--gpu", "h100", "--ctx", "2K", "--json")[1])["ctx"] == 2048
    # beyond max_position_embeddings (tiny: 4096) the engine refuses without its override
    code, _, err = fit("--gpu", "h100", "--ctx", "8192")
    assert code == 1 and "max_position_embeddings 4,096" in err and "--allow-long-context" in err
    assert fit("--gpu", "h100", "--ctx", "8192", "--allow-long-context")[0] == 0
    # how many N-token requests at once, and memory another process already holds
    doc = json.loads(fit("--gpu", "h100", "--ctx", "4096", "--json")[1])
    assert doc["concurrent_requests"] == min(doc["max_num_seqs"], doc["kv_tokens"] // 4096)
    used = json.loads(fit("--gpu", "h100", "--ctx", "4096", "--gpu-mem-used", "10GiB", "--json")[1])
    assert used["gpu"]["in_use_bytes"] == 10 * GIB
    code, _, err = fit("--gpu", "h100", "--ctx", "4096", "--gpu-mem-used", "78GiB")
    assert code == 1  # the fork requests 0.92 of the card: with 78 GiB taken it cannot start
    auto = json.loads(fit("--gpu", "h100", "--ctx", "auto", "--json")[1])
    assert auto["ctx_auto"] and auto["verdict"] == "fits" and auto["ctx"] == 4096  # capped by the model's positions


def test_cli_marginal_has_its_own_exit_code(tiny, capsys):
    """A budget that holds the context at the cheap end of the measured terms only: exit 5, naming the term."""
    doc = json.loads(run_cli(capsys, "fit", tiny, "--tp", "2", "--gpu", "h100", "--ctx", "4096", "--json")[1])
    low, high = doc["band"]["low"], doc["band"]["high"]
    assert low["kv_tokens"] > doc["kv_tokens"] > high["kv_tokens"]
    # a utilization between the two ends: the budget holds the context's KV at the cheap end only
    need = doc["ranks"][0]["weight_bytes"] + 2 * 64 * 1460 * 5 * 64  # weights and a few blocks of KV
    inside = [t for t in doc["reserve"] if not t["outside_budget"]]
    low_total = need + sum(t["low"] for t in inside)
    high_total = need + sum(t["high"] for t in inside)
    u = round((low_total + high_total) / 2 / doc["gpu"]["total_bytes"], 4)
    code, out, _ = run_cli(capsys, "fit", tiny, "--tp", "2", "--gpu", "h100", "--ctx", "4096",
                           "--gpu-memory-utilization", str(u))
    assert code == 5 and "marginal:" in out and "decided by" in out
    doc = json.loads(run_cli(capsys, "fit", tiny, "--tp", "2", "--gpu", "h100", "--ctx", "4096",
                             "--gpu-memory-utilization", str(u), "--json")[1])
    assert doc["verdict"] == "marginal" and doc["band"]["low"]["fits"] and not doc["band"]["high"]["fits"]


# ---- the differential test against vLLM 0.34.0's spec classes ----------------------------------------------

ORACLE = r"""
import ast, json, math, sys
from types import SimpleNamespace
import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, KVQuantMode
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
import vllm

root = vllm.__path__[0]

def constant_return(path, function):
    # the engine's own constant: `return N` in `function` of `path`
    tree = ast.parse(open(f"{root}/{path}").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Return) and isinstance(sub.value, ast.Constant):
                    return sub.value.value

def nvfp4_row():
    # MLAAttention.get_kv_cache_spec's {"nvfp4_ds_mla": N}.get(...)
    tree = ast.parse(open(f"{root}/model_executor/layers/attention/mla_attention.py").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "nvfp4_ds_mla" for k in node.keys):
            return node.values[0].value

ROW = {"fp8_ds_mla": constant_return("v1/attention/backend.py", "get_fp8_ds_mla_row_bytes"), "nvfp4_ds_mla": nvfp4_row()}
DTYPE = {"bf16": torch.bfloat16, "fp8_e4m3": STR_DTYPE_TO_TORCH_DTYPE["fp8_e4m3"],
         "fp8_ds_mla": STR_DTYPE_TO_TORCH_DTYPE["fp8_ds_mla"], "nvfp4_ds_mla": STR_DTYPE_TO_TORCH_DTYPE["nvfp4_ds_mla"]}
MODE = {"bf16": KVQuantMode.NONE, "fp8_e4m3": KVQuantMode.FP8_PER_TENSOR, "fp8_ds_mla": KVQuantMode.FP8_PER_TENSOR,
        "nvfp4_ds_mla": KVQuantMode.NVFP4_DS_MLA}

out = []
for case in json.load(sys.stdin):
    stored = case["stored"]
    # MLAAttention.get_kv_cache_spec and DeepseekV32IndexerCache.get_kv_cache_spec, block_size 64
    latent = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=DTYPE[stored],
                              cache_dtype_str=stored, kv_quant_mode=MODE[stored], state_content_bytes=ROW.get(stored))
    indexer = MLAAttentionSpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8)
    specs = [latent] * case["latent_layers"] + [indexer] * case["indexer_layers"]
    bytes_per_block = sum(s.page_size_bytes for s in specs)  # kv_cache_planning._get_kv_cache_bytes_per_block
    available = case["available"]
    num_blocks = available // bytes_per_block  # kv_cache_planning: available_memory // bytes_per_block
    cfg = SimpleNamespace(model_config=SimpleNamespace(max_model_len=case["ctx"]),
                          parallel_config=SimpleNamespace(decode_context_parallel_size=case["dcp"]))
    needed = sum(s.max_memory_usage_bytes(cfg) for s in specs)  # check_enough_kv_cache_memory
    per_request = latent.max_num_blocks_per_req(cfg, case["ctx"])
    # the pool less the null block (block_pool.BlockPool.__init__) serves the request
    serves = available > 0 and needed <= available and num_blocks - 1 >= per_request
    out.append({"latent_page": latent.page_size_bytes, "bytes_per_block": bytes_per_block,
                "tokens": max(0, num_blocks - 1) * 64 * case["dcp"], "serves": serves})
json.dump(out, sys.stdout)
"""


def vllm034_dir() -> Path | None:
    for candidate in (os.environ.get("TRELLIS_VLLM034"), REPO / ".vllm034"):
        if candidate and (Path(candidate) / "vllm" / "v1" / "kv_cache_interface.py").is_file():
            return Path(candidate)
    return None


def grid():
    """Every point of the acceptance grid, with a budget per rank from the production shape's weights."""
    totals = {SM90: 81_559 << 20, SM100: 183_359 << 20, SM120: 97_887 << 20}
    weights = {4: 81 * GIB, 8: 41 * GIB}  # about what the production checkpoint puts on a rank
    reserve = 6 * GIB
    for tp, dcp, asked, family, ctx, util in itertools.product(
            (4, 8), (1, 2, 4), ("auto", "bf16", "fp8", "fp8_ds_mla", "nvfp4_ds_mla"), (SM90, SM100, SM120),
            (32_768, 131_072, 202_752), (0.9, 0.95)):
        available = math.ceil(totals[family] * util) - weights[tp] - reserve
        yield tp, dcp, asked, family, ctx, util, available


@pytest.mark.slow
def test_differential_grid_against_vllm_034_spec_classes():
    target = vllm034_dir()
    if target is None:
        pytest.skip("vLLM 0.34.0 not installed in .vllm034 (pip install --no-deps --target .vllm034 vllm==0.34.0)")
    engine = ENGINES[UPSTREAM]
    cases, ours, refused = [], [], 0
    for tp, dcp, asked, family, ctx, util, available in grid():
        try:
            lay = resolve_layout(engine, family, asked, dcp, 64 // tp, 512, 64)
        except EngineRefusal:
            refused += 1
            continue
        kv = kv_per_token(ARCH, lay, dcp, False, engine)
        kv = type(kv)(kv.layout, kv.latent_per_layer, kv.indexer_per_layer, kv.latent_layers, kv.indexer_layers, dcp,
                      granular=False)  # the spec classes' arithmetic, before the extensible cache's granules
        cases.append({"stored": lay.stored, "latent_layers": kv.latent_layers, "indexer_layers": kv.indexer_layers,
                      "dcp": dcp, "ctx": ctx, "available": available})
        ours.append((kv, ctx, available))
    assert refused and cases
    env = dict(os.environ, PYTHONPATH=str(target))
    run = subprocess.run([sys.executable, "-c", ORACLE], input=json.dumps(cases), capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    engine_says = json.loads(run.stdout)
    assert len(engine_says) == len(cases)
    for (kv, ctx, available), case, theirs in zip(ours, cases, engine_says):
        assert kv.latent_per_layer * 64 == theirs["latent_page"], case
        assert kv.block_bytes == theirs["bytes_per_block"], case
        assert abs(kv.tokens(available) - theirs["tokens"]) <= kv.block_tokens, case  # within one block
        fits = kv.bytes_for(ctx) <= available
        assert fits == theirs["serves"], case  # never "fits" where the engine's check fails, nor the reverse


def test_another_tp_than_the_slices_is_answered_after_re_slicing(tiny, capsys):
    """A TP 2 checkpoint asked at TP 4: the answer after re-slicing, naming the repack step (issue 54 item 4)."""
    code, out, _ = run_cli(capsys, "fit", tiny, "--tp", "4", "--gpu", "h100", "--ctx", "2048")
    assert code == 0 and "after re-slicing to TP 4" in out and "trellis repack SOURCE OUT --to tr3 --tp 4" in out
    doc = json.loads(run_cli(capsys, "fit", tiny, "--tp", "4", "--gpu", "h100", "--ctx", "2048", "--json")[1])
    assert doc["resliced_to_tp"] == 4 and len(doc["ranks"]) == 4
    # one definition of the weights: the JSON's weight_bytes is the text's "weights" row (stored + estimate)
    for rank in doc["ranks"]:
        assert rank["weight_bytes"] == rank["stored_weight_bytes"] + rank["absent_weight_bytes"]
