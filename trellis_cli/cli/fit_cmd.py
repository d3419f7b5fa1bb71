"""`trellis fit SOURCE --tp N`: will this checkpoint fit on these GPUs at this context (one screen, or --json)."""

from __future__ import annotations

import re
from typing import Annotated, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.cli.options import CacheDirOpt, EndpointOpt, OfflineOpt, RevisionOpt, TokenOpt, open_cli_source
from trellis_cli.errors import EXIT_FINDINGS, EXIT_MARGINAL, UsageError
from trellis_cli.fit.engines import DEFAULT_ENGINE

HELP = (
    "Will this checkpoint fit on these GPUs at this context, before a download and a one-hour bring-up? From "
    "headers and config.json only, as the named engine version decides on the GPU family: the KV layout its "
    "attention backend stores (or the refusal it makes), weights per rank exact to the byte, the engine's "
    "defaults and budget less a named reserve (measured terms as a low / typical / high band), the KV tokens, a "
    "verdict, and the cheapest remedies with their values (docs/fit.md).\n\n"
    "Exit 0 when it fits over the whole band, 5 when it is marginal (fits only at the cheap end of the band), 1 "
    "when it does not fit or the engine refuses the settings.\n\n"
    "Examples:\n\n"
    "  trellis fit org/GLM-5.2-EXL3-TR3 --tp 4 --gpu rtx-pro-6000 --ctx 131072 --kv-dtype fp8\n\n"
    "  trellis fit ./GLM-TR3 --tp 8 --gpu H100 --ctx 200k --kv-dtype fp8 --engine vllm-0.34\n\n"
    "  trellis fit ./GLM-TR3 --tp 4 --dcp 4 --gpu-mem 96GiB --arch sm_120 --ctx auto --json"
)

_BUDGET = "Budget"
_ENGINE = "Engine"
_MAX_CTX_TEXT = 20
_CTX = re.compile(r"(\d{1,15}(?:\.\d{1,9})?)([kKmMgG]?)")


def parse_ctx(text: str | None) -> tuple[int | None, bool]:
    """`--ctx 131072`, `200k` (10^3), `128K` (2^10), as vLLM's --max-model-len reads them, or `auto`."""
    if text is None:
        return None, False
    value = text.strip()
    if value.lower() == "auto":
        return None, True
    m = _CTX.fullmatch(value) if len(value) <= _MAX_CTX_TEXT else None
    if m is None:
        shown = repr(value) if len(value) <= 40 else f"a value of {len(value):,} characters"
        raise UsageError(f"--ctx: {shown} is not a token count (e.g. 131072, 200k = 200,000, 128K = 131,072, or "
                         "auto)")
    number, suffix = m.groups()
    if suffix and suffix.isupper():
        if "." in number:
            raise UsageError(f"--ctx {value}: no decimals with a binary suffix (did you mean {number}{suffix.lower()}?)")
        return int(number) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[suffix], False
    if "." in number and not suffix:
        raise UsageError(f"--ctx {value}: a token count is a whole number")
    whole, _, frac = number.partition(".")
    mult = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[suffix]
    return int(whole) * mult + (int(frac) * mult // 10 ** len(frac) if frac else 0), False


def fit_command(
    source: Annotated[Optional[str], typer.Argument(help="Checkpoint directory, or Hub id org/name or "
                                                    "org/name@rev (required).", show_default=False)] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", help="Tensor-parallel degree, the number of GPUs "
                                              "(required). Another TP than a rank-sliced checkpoint's is "
                                              "answered after re-slicing.", rich_help_panel=_BUDGET,
                                              show_default=False)] = None,
    dcp: Annotated[int, typer.Option("--dcp", help="Decode context parallelism (divides the KV cache).",
                                     rich_help_panel=_BUDGET)] = 1,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU: rtx-pro-6000, h100, h200, b200 (any case; "
                                               "default: the local GPU).", rich_help_panel=_BUDGET)] = None,
    gpu_mem: Annotated[Optional[str], typer.Option("--gpu-mem", help="GPU memory with a unit, e.g. 96GiB "
                                                   "(binary) or 96GB (decimal); needs --arch.",
                                                   rich_help_panel=_BUDGET)] = None,
    arch: Annotated[Optional[str], typer.Option("--arch", help="GPU family: sm_90, sm_100 or sm_120 (known "
                                                "from --gpu).", rich_help_panel=_BUDGET)] = None,
    gpu_mem_used: Annotated[Optional[str], typer.Option("--gpu-mem-used", help="Memory already in use on "
                                                        "each card by other processes, e.g. 2GiB.",
                                                        rich_help_panel=_BUDGET)] = None,
    ctx: Annotated[Optional[str], typer.Option("--ctx", help="Context length (max_model_len): 131072, 200k, "
                                               "128K, or auto (the longest that fits). Default: the model's "
                                               "max_position_embeddings.", rich_help_panel=_BUDGET)] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option("--max-num-seqs", help="Concurrent sequences "
                                                        "(default: the engine's, 1024 on 70 GiB cards).",
                                                        rich_help_panel=_BUDGET, show_default=False)] = None,
    max_batched: Annotated[Optional[int], typer.Option("--max-num-batched-tokens", help="Tokens per forward "
                                                       "pass (default: the engine's for the card).",
                                                       rich_help_panel=_BUDGET, show_default=False)] = None,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="--kv-cache-dtype as asked of the engine: auto, "
                                          "bf16 (bfloat16), fp8 (fp8_e4m3), fp8_ds_mla, nvfp4_ds_mla; the "
                                          "engine's backend decides the stored layout.",
                                          rich_help_panel=_BUDGET)] = "auto",
    utilization: Annotated[Optional[float], typer.Option("--gpu-memory-utilization", help="Share of GPU memory "
                                                         "the engine may use (default: the engine version's).",
                                                         rich_help_panel=_BUDGET, show_default=False)] = None,
    engine: Annotated[str, typer.Option("--engine", help="Engine version modelled: vllm-fork (default), "
                                        "vllm-fork-b12x, vllm-0.34.", rich_help_panel=_ENGINE)] = DEFAULT_ENGINE,
    mtp: Annotated[bool, typer.Option("--mtp/--no-mtp", help="The engine loads the MTP layer (MTP speculative "
                                      "decoding).", rich_help_panel=_ENGINE)] = False,
    kv_fp8_rope: Annotated[bool, typer.Option("--kv-fp8-rope", help="KV_FP8_ROPE=1: the b12x nvfp4_ds_mla "
                                              "record keeps RoPE in fp8 (368 B, not 432).",
                                              rich_help_panel=_ENGINE)] = False,
    allow_long: Annotated[bool, typer.Option("--allow-long-context", help="VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: a "
                                             "context past max_position_embeddings.",
                                             rich_help_panel=_ENGINE)] = False,
    revision: RevisionOpt = None,
    token: TokenOpt = None,
    offline: OfflineOpt = False,
    endpoint: EndpointOpt = None,
    cache_dir: CacheDirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Emit one JSON document with every term.")] = False,
) -> None:
    from trellis_cli.fit.engines import kv_dtype_name
    from trellis_cli.fit.gpus import choose_gpu, parse_size
    from trellis_cli.fit.run import FITS, MARGINAL, FitRequest, check_request, fit_source

    if source is None:
        raise UsageError("SOURCE is required: the checkpoint directory or Hub id whose fit is asked")
    if tp is None:
        raise UsageError("--tp N is required (the tensor-parallel degree)")
    ctx_tokens, ctx_auto = parse_ctx(ctx)
    request = FitRequest(tp=tp, gpu=choose_gpu(gpu, gpu_mem, arch), dcp=dcp, ctx=ctx_tokens, ctx_auto=ctx_auto,
                         max_num_seqs=max_num_seqs, kv_dtype=kv_dtype_name(kv_dtype),
                         gpu_memory_utilization=utilization, engine=engine, mtp=mtp, max_batched_tokens=max_batched,
                         mem_in_use=parse_size(gpu_mem_used, "--gpu-mem-used") if gpu_mem_used else 0,
                         kv_fp8_rope=kv_fp8_rope, allow_long_context=allow_long)
    check_request(request)  # before any download
    opened = open_cli_source(source, revision, token, offline, endpoint, cache_dir)
    with output.stage_progress(enabled=output.progress_enabled(as_json)) as advance:  # files done / listed
        result = fit_source(opened, request, progress=advance)
    if as_json:
        document = result.to_json()
        document["source"] = opened.describe()
        output.emit_json(document)
    else:
        from trellis_cli.cli.fit_render import render

        render(result, opened.description, result.dialect)
    if result.verdict == MARGINAL:
        raise typer.Exit(EXIT_MARGINAL)
    if result.verdict != FITS:
        raise typer.Exit(EXIT_FINDINGS)
