"""`trellis bench`: build the fused kernel, check it against the reference (--smoke), time it.

The options become one BenchRequest (bench/request.py, where which options combine is said once); bench_run
runs it; this module only shows the result."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.errors import CheckFailed

if TYPE_CHECKING:
    from trellis_cli.bench.run import BenchResult, CompileResult, PlanResult

DEFAULT_MS = "1,8,64,512,3072"
HELP = "Benchmark the fused mixed-bitrate MoE kernel on this GPU (exit 4 without a GPU or nvcc)."


def bench_command(
    source: Annotated[Optional[str], typer.Argument(help="Route-pack directory or TR3 checkpoint (path or org/name).")] = None,
    synthetic: Annotated[Optional[str], typer.Option("--synthetic", help="Synthetic layer preset, e.g. glm52-tp4.")] = None,
    partition: Annotated[Optional[str], typer.Option("--partition", help="Experts per tier for --synthetic, e.g. 192/64.")] = None,
    layer: Annotated[Optional[int], typer.Option("--layer", help="MoE layer (default: the first).")] = None,
    rank: Annotated[int, typer.Option("--rank", help="Tensor-parallel rank.")] = 0,
    ms: Annotated[str, typer.Option("--m", help="Token counts to time, comma-separated.")] = DEFAULT_MS,
    smoke: Annotated[bool, typer.Option("--smoke", help="Check fused vs two-pass vs float64 reference; exit 1 on any FAIL.")] = False,
    cold: Annotated[bool, typer.Option("--cold/--warm", help="Cycle weight copies so no replay hits L2 (default), or not.")] = True,
    replays: Annotated[int, typer.Option("--replays", min=100, help="CUDA-graph replays per measurement.")] = 100,
    seed: Annotated[int, typer.Option("--seed", help="Seed for synthetic weights, inputs and routes.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Emit one JSON document on stdout.")] = False,
    compile_only: Annotated[bool, typer.Option("--compile-only", help="Build the kernel library and exit (no GPU needed).")] = False,
    plan: Annotated[bool, typer.Option("--plan", help="Print the launch plan of each --m for the layer on --arch (or this GPU), checked against the arch's limits; no build, no GPU needed (exit 4 where no plan fits).")] = False,
    arch: Annotated[Optional[str], typer.Option("--arch", help="Target arch for --compile-only or --plan, e.g. sm_90 (default: this GPU's, else sm_90).")] = None,
    codebook: Annotated[Optional[str], typer.Option("--codebook", help="Codebook to build with --compile-only: mcg, 3inst or mul1 (default: all).")] = None,
    kernels: Annotated[Optional[str], typer.Option("--kernels", help="Kernel set to build with --compile-only: all (every K, default) or k3k4 (only the K3/K4 kernels, all a TR3 checkpoint uses).")] = None,
    jobs: Annotated[Optional[int], typer.Option("--jobs", help="Kernel units compiled at once (default: $TRELLIS_BUILD_JOBS, else one per CPU core).")] = None,
    mixed_gap: Annotated[bool, typer.Option("--mixed-gap", help="Time the --synthetic layer beside uniform layers of each K (same shape, routes, interleaved) and report its gap to their interpolation.")] = False,
    tp: Annotated[Optional[int], typer.Option("--tp", help="Run the layer tensor-parallel: N rank processes, one GPU and one slice each, outputs all-reduced.")] = None,
    device: Annotated[str, typer.Option("--device", help="cuda, or cpu: --smoke [--tp N] with the CPU reference per rank over gloo (checks the slicing without GPUs).")] = "cuda",
    compare: Annotated[Optional[str], typer.Option("--compare", help="Also time a peer's MoE layer on the same tensors, inputs and routes: exllamav3 (one call per K tier).")] = None,
) -> None:
    from trellis_cli.bench.request import BenchRequest, parse_ms
    from trellis_cli.bench.run import BenchReporter, bench_run

    request = BenchRequest(source=source, synthetic=synthetic, partition=partition, layer=layer, rank=rank,
                           ms=parse_ms(ms), smoke=smoke, cold=cold, replays=replays, seed=seed,
                           compile_only=compile_only, plan=plan, arch=arch, codebook=codebook, kernels=kernels,
                           jobs=jobs, mixed_gap=mixed_gap, tp=tp, device=device, compare=compare)
    reporter = BenchReporter(log=output.log, notice=lambda line: output.print_line(line, err=True),
                             quiet=output.state.quiet, debug=output.state.debug)
    result = bench_run(request, reporter)
    if result is not None:  # None: a launched rank other than 0 (rank 0 reports)
        render(result, as_json)


def render(result: BenchResult, as_json: bool) -> None:
    """The result on stdout (a table, lines, or its JSON document); then exit 1 for a failed check."""
    from trellis_cli.bench.run import CompileResult, PlanResult, SmokeResult, TimingResult

    if as_json:
        output.emit_json(result.to_json())
    elif isinstance(result, PlanResult):
        _print_plans(result)
    elif isinstance(result, CompileResult):
        _print_compiled(result)
    elif isinstance(result, SmokeResult):
        output.print_checks(result.checks, "trellis bench --smoke")
    elif result.mode == "mixed-gap":
        from trellis_cli.cli.bench_gap import print_mixed_gap

        print_mixed_gap(result.document, result.description)
    elif result.mode == "tp":
        from trellis_cli.cli.bench_tp import print_tp_timing

        print_tp_timing(result.document)
    else:
        _print_throughput(result.document, result.description)
    failure = result.failure if isinstance(result, (SmokeResult, TimingResult)) else None
    if failure is not None:
        raise CheckFailed(failure)
    if isinstance(result, SmokeResult):
        output.log(result.passed_line)


def _print_plans(result: PlanResult) -> None:
    limits = result.limits
    output.print_line(f"{result.description}: plans for {limits.describe()} ({limits.source} limits; registers "
                      f"from {'ptxas' if result.ptxas_registers else 'the launch bounds'})")
    for plan in result.plans:
        output.print_line(f"  M={plan.m}: {plan.describe()}")


def _print_compiled(result: CompileResult) -> None:
    for built in result.report.libraries:
        state = "cached" if built.cached else "built"
        output.print_line(f"{state} {built.arch} {built.codebook} kernel ({built.kernels}) {built.build_hash} "
                          f"(nvcc {built.nvcc_version}): {built.path}")


def _print_throughput(result: dict, description: str) -> None:
    from rich.table import Table

    from trellis_cli.cli.bench_compare import compare_cells, compare_columns

    mode = "cold" if result["cold"] else "warm"
    table = Table(title=output.cell(f"{description}, {mode} L2, copy {result['copy_gbps']:.0f} GB/s"))
    for column in ("M", "fused med µs", "min", "max", "two-pass µs", "fused/2p", "experts", "MB", "GB/s",
                   "% copy", "TFLOP/s", "Gw/ms", *compare_columns(result["rows"])):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        f, t = r["fused"], r["two_pass"]
        table.add_row(str(r["m"]), f"{f['median_us']:.1f}", f"{f['min_us']:.1f}", f"{f['max_us']:.1f}",
                      f"{t['median_us']:.1f}", f"{r['fused_over_two_pass']:.2f}", str(r["experts"]),
                      f"{r['bytes'] / 1e6:.1f}", f"{r['gbps']:.0f}", f"{r['pct_copy_bw']:.1f}",
                      f"{r['tflops']:.1f}", f"{r['g_weights_per_ms']:.2f}", *compare_cells(r))
    output.stdout.print(table)
