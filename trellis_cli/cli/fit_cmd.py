"""`trellis fit SOURCE --tp N`: will this checkpoint fit on these GPUs at this context (one screen, or --json)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.cli.options import (CacheDirOpt, EndpointOpt, OfflineOpt, RevisionOpt, SourceArg, TokenOpt,
                                     open_cli_source)
from trellis_cli.errors import EXIT_FINDINGS

HELP = (
    "Will this checkpoint fit on these GPUs at this context, before a download and a one-hour bring-up? From "
    "headers and config.json only: weights per rank exact to the byte (split as the engine loads them), MLA + "
    "DSA indexer KV cache per token, the engine's budget less a named reserve, the KV tokens that fit, a "
    "verdict, and the cheapest remedies with their numbers (docs/fit.md).\n\n"
    "Exit 0 when it fits, 1 when it does not.\n\n"
    "Examples:\n\n"
    "  trellis fit org/GLM-5.2-EXL3-TR3 --tp 4 --gpu rtx-pro-6000 --ctx 131072\n\n"
    "  trellis fit ./GLM-TR3 --tp 4 --dcp 4 --gpu-mem 96GiB --kv-dtype fp8_ds_mla --json"
)


class KvDtype(str, Enum):
    auto = "auto"
    bf16 = "bf16"
    fp8 = "fp8"
    fp8_ds_mla = "fp8_ds_mla"
    nvfp4_ds_mla = "nvfp4_ds_mla"


class Engine(str, Enum):
    vllm = "vllm"


class GpuName(str, Enum):
    rtx_pro_6000 = "rtx-pro-6000"
    h100 = "h100"
    h200 = "h200"
    b200 = "b200"


_BUDGET = "Budget"


def register(app: typer.Typer) -> None:
    from trellis_cli.fit.run import DEFAULT_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, DEFAULT_UTILIZATION

    @app.command("fit", help=HELP)
    def fit_command(
        source: SourceArg = None,
        tp: Annotated[Optional[int], typer.Option("--tp", help="Tensor-parallel degree, the number of GPUs "
                                                  "(required).", rich_help_panel=_BUDGET, show_default=False)] = None,
        dcp: Annotated[int, typer.Option("--dcp", help="Decode context parallelism (divides the KV cache).",
                                         rich_help_panel=_BUDGET)] = 1,
        gpu: Annotated[Optional[GpuName], typer.Option("--gpu", help="GPU preset (default: the local GPU).",
                                                       rich_help_panel=_BUDGET)] = None,
        gpu_mem: Annotated[Optional[str], typer.Option("--gpu-mem", help="GPU memory, e.g. 96GiB or 80GB.",
                                                       rich_help_panel=_BUDGET)] = None,
        ctx: Annotated[Optional[int], typer.Option("--ctx", help="Context length in tokens (default: the model's "
                                                   "max_position_embeddings).", rich_help_panel=_BUDGET)] = None,
        max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", help="Concurrent sequences (the engine's limit).",
                                                  rich_help_panel=_BUDGET)] = DEFAULT_MAX_NUM_SEQS,
        max_batched: Annotated[int, typer.Option("--max-num-batched-tokens", help="Tokens per forward pass (sets "
                                                 "the activation peak and the kernel workspace).",
                                                 rich_help_panel=_BUDGET)] = DEFAULT_BATCHED_TOKENS,
        kv_dtype: Annotated[KvDtype, typer.Option("--kv-dtype", help="KV cache layout (auto: the model dtype, bf16).",
                                                  rich_help_panel=_BUDGET)] = KvDtype.auto,
        utilization: Annotated[float, typer.Option("--gpu-memory-utilization", help="Share of GPU memory the "
                                                   "engine may use.", rich_help_panel=_BUDGET)] = DEFAULT_UTILIZATION,
        engine: Annotated[Engine, typer.Option("--engine", help="Whose sharding table and limits.",
                                               rich_help_panel=_BUDGET)] = Engine.vllm,
        mtp: Annotated[bool, typer.Option("--mtp/--no-mtp", help="The engine loads the MTP layer (MTP speculative "
                                          "decoding).", rich_help_panel=_BUDGET)] = False,
        revision: RevisionOpt = None,
        token: TokenOpt = None,
        offline: OfflineOpt = False,
        endpoint: EndpointOpt = None,
        cache_dir: CacheDirOpt = None,
        as_json: Annotated[bool, typer.Option("--json", help="Emit one JSON document with every term.")] = False,
    ) -> None:
        from trellis_cli.dialects import open_checkpoint
        from trellis_cli.errors import UsageError
        from trellis_cli.fit.gpus import choose_gpu
        from trellis_cli.fit.run import FitRequest, check_request, fit

        if tp is None:
            raise UsageError("--tp N is required (the tensor-parallel degree)")
        request = FitRequest(tp=tp, gpu=choose_gpu(gpu.value if gpu else None, gpu_mem), dcp=dcp, ctx=ctx,
                             max_num_seqs=max_num_seqs, kv_dtype=kv_dtype.value, gpu_memory_utilization=utilization,
                             engine=engine.value, mtp=mtp, max_batched_tokens=max_batched)
        check_request(request)  # before any download
        opened = open_cli_source(source, revision, token, offline, endpoint, cache_dir)
        with output.progress_bar(f"reading headers of {opened.description}", None,
                                 enabled=output.progress_enabled(as_json)):
            checkpoint = open_checkpoint(opened)
            result = fit(checkpoint, request)
        if as_json:
            document = result.to_json()
            document["source"] = opened.describe()
            output.emit_json(document)
        else:
            from trellis_cli.cli.fit_render import render

            render(result, opened.description, checkpoint.dialect)
        if not result.fits:
            raise typer.Exit(EXIT_FINDINGS)
