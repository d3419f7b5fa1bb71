"""`trellis bench`: build the fused kernel, check it against the reference (--smoke), time it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.errors import CheckFailed, GpuUnavailable, UsageError

DEFAULT_MS = "1,8,64,512,3072"


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench_command(
        source: Annotated[Optional[str], typer.Argument(help="Repacked directory or TR3 checkpoint (path or org/name).")] = None,
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
        """Benchmark the fused mixed-bitrate MoE kernel on this GPU (exit 4 without a GPU or nvcc)."""
        from trellis_cli.kernel.build import build_jobs, check_codebook, check_kernels

        jobs = build_jobs(jobs)
        if codebook is not None:
            check_codebook(codebook)
        if kernels is not None:
            check_kernels(kernels)
        if plan:
            if compile_only or smoke or compare or mixed_gap or tp:
                raise UsageError("--plan prints launch plans only: it does not combine with --compile-only, "
                                 "--smoke, --compare, --mixed-gap or --tp")
            from trellis_cli.cli.bench_plan import layer_geometry, run_plan_check

            m_list = _parse_ms(ms)
            check_bench_arguments(source, synthetic, partition)
            run_plan_check(layer_geometry(source, synthetic, partition, layer, rank),
                           _parse_arch(arch) if arch else None, m_list, as_json)
            return
        if compile_only:
            if compare:
                raise UsageError("--compare applies to a throughput run, not to --compile-only")
            _compile_only(_parse_arch(arch) if arch else None, codebook, kernels or "all", jobs, as_json)
            return
        if arch:
            raise UsageError("--arch applies to --compile-only (a run builds for the GPU present)")
        if codebook:
            raise UsageError("--codebook applies to --compile-only (a run builds the codebook of its layer)")
        if kernels:
            raise UsageError("--kernels applies to --compile-only (a run builds the kernels its layer needs)")
        m_list = _parse_ms(ms)
        from trellis_cli.cli.bench_compare import check_compare, locate_compare

        check_compare(compare, smoke=smoke, mixed_gap=mixed_gap, tp=tp, device=device)
        check_bench_arguments(source, synthetic, partition)  # usage (2) and source (3) errors before the GPU (4)
        peer_location = locate_compare(compare)  # a missing peer is one line and no comparison, not an error
        from trellis_cli.cli.bench_tp import TpRequest, run_tp_bench, wants_tp

        if wants_tp(tp, device):
            if mixed_gap:
                raise UsageError("--mixed-gap times one GPU's layers; it does not combine with --tp or --device")
            run_tp_bench(TpRequest(source, synthetic, partition, layer, rank, tp, device, m_list, smoke, cold,
                                   replays, seed, as_json))
            return
        gap_plan = None
        if mixed_gap:  # its argument errors come before the GPU check, like --m's
            from trellis_cli.bench.mixed_gap import plan_mixed_gap

            gap_plan = plan_mixed_gap(source, synthetic, partition, smoke)
        _require_gpu()
        from trellis_cli.bench.source import load_bench_source
        from trellis_cli.bench.synthetic import get_preset
        from trellis_cli.kernel.abi import default_library
        from trellis_cli.kernel.build import kernels_for
        from trellis_cli.kernel.plan import kernel_set

        if gap_plan:
            from trellis_cli.cli.bench_gap import run_mixed_gap_bench

            output.log(f"building or loading the kernel library for the {gap_plan.preset.codebook} codebook ...")
            library = default_library(gap_plan.preset.codebook, kernels=kernels_for(gap_plan.preset.tier_k),
                                      jobs=jobs, log=output.log)
            run_mixed_gap_bench(gap_plan, library, m_list, cold=cold, replays=replays, seed=seed, as_json=as_json)
            return
        bench = load_bench_source(source, synthetic=synthetic, partition=partition, layer=layer, rank=rank,
                                  device="cuda", seed=seed)
        output.log(f"source: {bench.description}")
        output.log(f"building or loading the kernel library for the {bench.pack.codebook} codebook ...")
        # A synthetic --smoke also checks each of the preset's K alone: the kernel set covers them all.
        needed = kernels_for(get_preset(synthetic).tier_k) if synthetic else kernel_set(bench.pack)
        library = default_library(bench.pack.codebook, kernels=needed, jobs=jobs, log=output.log)
        from trellis_cli.bench.environment import kernel_line

        output.log(kernel_line(library))
        if smoke:
            _run_smoke(bench, library, synthetic, seed, as_json)
        else:
            _run_throughput(bench, library, m_list, cold, replays, seed, as_json, (compare, peer_location))


def _parse_ms(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--m {text!r}: expected comma-separated token counts like 1,8,64") from None
    if not values or any(v < 1 or v > 65536 for v in values):
        raise UsageError(f"--m {text!r}: token counts must be 1..65536")
    return values


def _parse_arch(text: str) -> str:
    from trellis_cli.kernel.nvcc import normalize_arch

    try:
        return normalize_arch(text)
    except GpuUnavailable as err:  # a misspelt option, not a missing GPU
        raise UsageError(f"--arch {text!r}: {err}") from None


def check_bench_arguments(source: str | None, synthetic: str | None, partition: str | None) -> None:
    """What can be refused without a GPU: the SOURCE / --synthetic choice, the preset, the partition, and a
    local SOURCE that does not exist. (A Hub id is resolved when it is read.)"""
    from trellis_cli.bench.source import choose_source
    from trellis_cli.sources import open_source, parse_repo_spec

    if choose_source(source, synthetic, partition) is not None:
        return
    if parse_repo_spec(source) is None or Path(source).expanduser().exists():
        open_source(source)  # local: cheap, and a missing path is exit 3


def _require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise GpuUnavailable("no CUDA GPU visible: trellis bench runs the kernel on an NVIDIA GPU "
                             "(use --compile-only to only build it)")


def _compile_only(arch: str | None, codebook: str | None, kernels: str, jobs: int, as_json: bool) -> None:
    import torch

    from trellis_cli.kernel.build import BUILD_ORDER, build_libraries

    target = arch or (None if torch.cuda.is_available() else "sm_90")
    codebooks = (codebook,) if codebook else BUILD_ORDER
    output.log(f"compiling the kernel for {target or 'this GPU'}, codebook(s) {', '.join(codebooks)}, "
               f"kernel set {kernels} ...")
    report = build_libraries(target, codebooks, kernels=kernels, jobs=jobs, log=output.log)
    libraries = report.libraries
    if as_json:
        output.emit_json({
            "arch": libraries[0].arch, "nvcc": libraries[0].nvcc_version, "jobs": report.jobs,
            "units": report.units, "compiled": report.compiled, "seconds": round(report.seconds, 1),
            "libraries": [{"codebook": b.codebook, "kernels": b.kernels, "build_hash": b.build_hash,
                           "path": str(b.path), "cached": b.cached} for b in libraries],
        })
        return
    for built in libraries:
        state = "cached" if built.cached else "built"
        output.print_line(f"{state} {built.arch} {built.codebook} kernel ({built.kernels}) {built.build_hash} "
                          f"(nvcc {built.nvcc_version}): {built.path}")


def _smoke_packs(bench, synthetic: str | None, seed: int):
    from trellis_cli.bench.synthetic import get_preset, synthetic_pack

    if synthetic:
        preset = get_preset(synthetic)
        n = preset.experts
        mixed = "/".join(str(p) for p in bench.pack.tier_size)
        packs = [(f"K{preset.tier_k[0]}-only", synthetic_pack(preset, (n, 0), device="cuda", seed=seed + 1)),
                 (f"K{preset.tier_k[1]}-only", synthetic_pack(preset, (0, n), device="cuda", seed=seed + 2)),
                 (f"mixed {mixed}", bench.pack)]
        other = (160, 96) if tuple(bench.pack.tier_size) != (160, 96) else (206, 50)
        reuse = ("mixed " + "/".join(map(str, other)), synthetic_pack(preset, other, device="cuda", seed=seed + 3))
        return packs, reuse
    views = [(f"tier {t} (K{k}) only", _tier_view(bench.pack, t)) for t, k in enumerate(bench.pack.tier_k)]
    if len(views) < 2:
        return [("layer", bench.pack)], None
    return views + [("layer", bench.pack)], None


def _tier_view(pack, tier: int):
    """The pack with every expert outside `tier` unmapped (served by nobody: contributes zero)."""
    import torch

    from trellis_cli.formats.route_pack import split_descriptor

    g2c = pack.global_to_combined
    tiers = torch.where(g2c >= 0, split_descriptor(pack.descriptors[g2c.clamp(min=0).long()])[0], -1)
    return dataclasses.replace(pack, global_to_combined=torch.where(tiers == tier, g2c, -1).to(torch.int32))


def _run_smoke(bench, library, synthetic: str | None, seed: int, as_json: bool) -> None:
    from trellis_cli.bench.environment import environment
    from trellis_cli.bench.smoke import run_smoke

    packs, reuse = _smoke_packs(bench, synthetic, seed)
    checks = run_smoke(packs, library, seed=seed + 1, reuse_pack=reuse, log=output.log)
    failed = [c for c in checks if not c.passed]
    if as_json:
        output.emit_json({"source": bench.description, "environment": environment(library),
                          "checks": [dataclasses.asdict(c) for c in checks], "passed": not failed})
    else:
        output.print_checks(checks, "trellis bench --smoke")
    if failed:
        raise CheckFailed(f"smoke: {len(failed)} of {len(checks)} checks FAILED")
    output.log(f"smoke: all {len(checks)} checks passed")


def _run_throughput(bench, library, m_list: list[int], cold: bool, replays: int, seed: int, as_json: bool,
                    peer: tuple) -> None:
    from trellis_cli.bench.environment import environment
    from trellis_cli.bench.throughput import TOP_K, run_throughput
    from trellis_cli.cli.bench_compare import build_compare, compare_summary

    name, found = peer
    comparer = build_compare(name, found, min(TOP_K, int(bench.pack.global_to_combined.shape[0])))
    result = run_throughput(bench.pack, library, m_list, cold=cold, replays=replays, seed=seed + 1234,
                            log=output.log, compare=None if isinstance(comparer, str) else comparer)
    summary, wrong = compare_summary(name, comparer, result["rows"])
    if as_json:
        output.emit_json({"source": bench.description, "environment": environment(library), **result, **summary})
    else:
        _print_throughput(result, bench.description)
    if wrong:
        raise CheckFailed(f"--compare {name}: its output disagrees with the float64 reference, so its time is "
                          f"not reported ({'; '.join(wrong)}): the tensors given to it are not the layer's")


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
