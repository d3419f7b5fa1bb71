"""`bench_run(request) -> BenchResult`: one `trellis bench` run, the one call behind the command.

Everything that can be refused without a GPU is refused first, in this order: the request itself (usage, exit
2, bench/request.py), the SOURCE / --synthetic choice and a local SOURCE that does not exist (usage 2, source
3), the mode's own arguments (the partition a mixed gap needs, the TP a source can be sliced to); then the GPU
(GpuUnavailable, exit 4). A check that fails is part of the result (`failure`), so that the caller shows what
was measured before it reports the failure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence, Union

from trellis_cli.bench.request import BenchRequest
from trellis_cli.errors import GpuUnavailable, UsageError

if TYPE_CHECKING:  # torch and the kernel's modules load with the run that needs them
    from trellis_cli.bench.smoke import Check
    from trellis_cli.kernel.arch_limits import ArchLimits
    from trellis_cli.kernel.build import BuildReport
    from trellis_cli.kernel.plan import LaunchPlan


def _quiet(_message: str) -> None:
    pass


@dataclass
class BenchReporter:
    """Where a run speaks while it works."""

    log: Callable[[str], None] = _quiet  # what it is doing (silenced by --quiet)
    notice: Callable[[str], None] = _quiet  # said even with --quiet: a comparison skipped, and why
    quiet: bool = False  # the rank processes of a --tp run log nothing either
    debug: bool = False  # a failing rank process reports its traceback


@dataclass(frozen=True)
class PlanResult:
    """`--plan`: the launch plan of each M for the layer on an arch, every one within its limits."""

    description: str
    limits: ArchLimits
    ptxas_registers: bool  # registers as ptxas gave them (a library built here), else the launch bounds
    plans: list[LaunchPlan]  # one per M

    def to_json(self) -> dict[str, Any]:
        return {"source": self.description, "limits": asdict(self.limits),
                "registers_from": "ptxas" if self.ptxas_registers else "launch bounds",
                "plans": [asdict(p) for p in self.plans]}


@dataclass(frozen=True)
class CompileResult:
    """`--compile-only`: the libraries built or found in the cache."""

    report: BuildReport

    def to_json(self) -> dict[str, Any]:
        report, libraries = self.report, self.report.libraries
        return {"arch": libraries[0].arch, "nvcc": libraries[0].nvcc_version, "jobs": report.jobs,
                "units": report.units, "compiled": report.compiled, "seconds": round(report.seconds, 1),
                "libraries": [{"codebook": b.codebook, "kernels": b.kernels, "build_hash": b.build_hash,
                               "path": str(b.path), "cached": b.cached} for b in libraries]}


@dataclass(frozen=True)
class SmokeResult:
    """`--smoke` (one GPU, or `--tp N` / `--device cpu`): every check, passed or not."""

    checks: list[Check]
    document: dict[str, Any]  # the JSON document
    tp: int | None = None  # the --tp run's degree; None on one GPU

    @property
    def failure(self) -> str | None:
        failed = [c for c in self.checks if not c.passed]
        if not failed:
            return None
        where = "smoke" if self.tp is None else f"smoke --tp {self.tp}"
        return f"{where}: {len(failed)} of {len(self.checks)} checks FAILED"

    @property
    def passed_line(self) -> str:
        if self.tp is None:
            return f"smoke: all {len(self.checks)} checks passed"
        return (f"smoke --tp {self.tp}: all {len(self.checks)} checks passed (reference: "
                f"{self.document['reference']})")

    def to_json(self) -> dict[str, Any]:
        return self.document


@dataclass(frozen=True)
class TimingResult:
    """A timed run: `throughput` (one GPU, with a peer's times under --compare), `mixed-gap`, or `tp`."""

    mode: str
    description: str
    document: dict[str, Any]  # the JSON document; its rows are what the table shows
    failure: str | None = None  # the peer's output disagreed with the reference: its time is not reported

    def to_json(self) -> dict[str, Any]:
        return self.document


BenchResult = Union[PlanResult, CompileResult, SmokeResult, TimingResult]


def bench_run(request: BenchRequest, reporter: BenchReporter | None = None) -> BenchResult | None:
    """Run `request`. None only on a rank other than 0 of a launched `--tp` run (rank 0 reports)."""
    reporter = reporter or BenchReporter()
    mode = request.mode
    if mode == "compile":
        return _compile(request, reporter)
    check_source(request)  # usage (2) and source (3) errors before the GPU (4)
    if mode == "plan":
        return _plan(request)
    peer = _locate_peer(request.compare, reporter)  # a missing peer is one line and no comparison, not an error
    if mode == "tp":
        return _tp(request, reporter)
    if mode == "mixed-gap":
        return _mixed_gap(request, reporter)
    return _one_gpu(request, reporter, peer)


def check_source(request: BenchRequest) -> None:
    """What can be refused without a GPU: the SOURCE / --synthetic choice, the preset, the partition, and a
    local SOURCE that does not exist. (A Hub id is resolved when it is read.)"""
    from trellis_cli.bench.source import choose_source
    from trellis_cli.sources import open_source, parse_repo_spec

    source = request.source
    if choose_source(source, request.synthetic, request.partition) is not None or source is None:
        return
    if parse_repo_spec(source) is None or Path(source).expanduser().exists():
        open_source(source)  # local: cheap, and a missing path is exit 3


def require_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        raise GpuUnavailable("no CUDA GPU visible: trellis bench runs the kernel on an NVIDIA GPU "
                             "(use --compile-only to only build it)")


# ---- --compile-only, --plan: no GPU --------------------------------------------------------------------------

def _compile(request: BenchRequest, reporter: BenchReporter) -> CompileResult:
    import torch

    from trellis_cli.kernel.build import BUILD_ORDER, build_jobs, build_libraries

    target = request.arch or (None if torch.cuda.is_available() else "sm_90")
    codebooks = (request.codebook,) if request.codebook else BUILD_ORDER
    kernels = request.kernels or "all"
    reporter.log(f"compiling the kernel for {target or 'this GPU'}, codebook(s) {', '.join(codebooks)}, "
                 f"kernel set {kernels} ...")
    return CompileResult(build_libraries(target, codebooks, kernels=kernels, jobs=build_jobs(request.jobs),
                                         log=reporter.log))


@dataclass(frozen=True)
class LayerGeometry:
    description: str
    hidden: int
    intermediate: int
    num_combined: int
    num_experts: int
    top_k: int
    codebook: str
    fast: bool  # every tier K3 or K4: the K3/K4 kernels serve it


def layer_geometry(request: BenchRequest) -> LayerGeometry:
    """A preset's geometry as it is (no weights made), or a SOURCE layer's, read on the CPU."""
    from trellis_cli.bench.source import choose_source, load_bench_source
    from trellis_cli.kernel.plan import kernel_set

    chosen = choose_source(request.source, request.synthetic, request.partition)
    if chosen is not None:
        preset, _ = chosen
        return LayerGeometry(f"synthetic {preset.name}", preset.hidden, preset.intermediate, preset.experts,
                             preset.experts, preset.top_k, preset.codebook, all(k in (3, 4) for k in preset.tier_k))
    bench = load_bench_source(request.source, synthetic=None, partition=None, layer=request.layer,
                              rank=request.rank, device="cpu")
    pack = bench.pack
    experts = int(pack.global_to_combined.shape[0])
    return LayerGeometry(bench.description, pack.hidden, pack.intermediate, pack.num_combined, experts,
                         min(8, experts), pack.codebook, kernel_set(pack) == "k3k4")


def _plan(request: BenchRequest) -> PlanResult:
    import torch

    from trellis_cli.kernel.arch_limits import device_limits, limits_for_arch, override_limits
    from trellis_cli.kernel.build import cache_dir
    from trellis_cli.kernel.nvcc import has_wgmma
    from trellis_cli.kernel.plan import KernelDoesNotFit, make_plan
    from trellis_cli.kernel.resources import read_record, record_path

    geometry = layer_geometry(request)
    arch = request.arch
    if arch is None and not torch.cuda.is_available() and override_limits() is None:
        raise UsageError("--plan without a GPU needs --arch, e.g. --arch sm_120")
    limits = limits_for_arch(arch) if arch else device_limits()
    # The registers ptxas gave the kernels, where this arch's library of the codebook has been built here;
    # otherwise each kernel's launch-bounds budget, the most it may take.
    stem = f"trellis_moe{'_k3k4' if geometry.fast else ''}-{limits.arch}-{geometry.codebook}-"
    built = sorted(cache_dir().glob(f"{stem}*.so"), key=lambda p: p.stat().st_mtime)
    usage = read_record(record_path(built[-1])) if built else {}
    plans = []
    for m in request.ms:
        try:
            plan = make_plan(m, geometry.top_k, geometry.hidden, geometry.intermediate, geometry.num_combined,
                             wgmma=limits.wgmma and has_wgmma(limits.arch), num_experts=geometry.num_experts,
                             limits=limits, codebook=geometry.codebook, fast=geometry.fast, usage=usage)
        except KernelDoesNotFit as err:
            raise KernelDoesNotFit(f"M={m}: {err}") from None
        plans.append(plan)
    return PlanResult(geometry.description, limits, bool(usage), plans)


# ---- --tp N / --device cpu -------------------------------------------------------------------------------------

def _tp(request: BenchRequest, reporter: BenchReporter) -> BenchResult | None:
    """The source's slicing (exit 2), then GPUs (exit 4): all before spawning."""
    from trellis_cli.bench.smoke import Check
    from trellis_cli.bench.tp import TpJob, launched_rank, require_gpus, run_tp
    from trellis_cli.bench.tp_source import plan_tp_source

    tp = 1 if request.tp is None else request.tp
    launched = launched_rank()
    if launched is not None and launched.world != tp:
        raise UsageError(f"--tp {tp} but the launcher's WORLD_SIZE is {launched.world}")
    plan = plan_tp_source(request.source, synthetic=request.synthetic, partition=request.partition,
                          layer=request.layer, tp=tp, tp_given=request.tp is not None)
    if request.device == "cuda":
        require_gpus(tp, None if launched is None else launched.local_rank)
        from trellis_cli.kernel.abi import default_library

        reporter.log("building or loading the kernel library ...")
        default_library()  # built here once, so the ranks only load it
    reporter.log(f"source: {plan.description}, {tp} rank process(es) on {request.device}")
    job = TpJob(plan, request.device, request.smoke, tuple(request.ms), request.cold, request.replays,
                request.seed, reporter.quiet, reporter.debug)
    doc = run_tp(job)
    if doc is None:  # a launched rank other than 0: rank 0 reports
        return None
    if request.smoke:
        return SmokeResult([Check(**c) for c in doc["checks"]], dict(doc), tp=doc["tp"])
    return TimingResult("tp", doc["source"], dict(doc))


# ---- one GPU: --mixed-gap, --smoke, the throughput run ---------------------------------------------------------

def _mixed_gap(request: BenchRequest, reporter: BenchReporter) -> TimingResult:
    from trellis_cli.bench.environment import environment
    from trellis_cli.bench.mixed_gap import plan_mixed_gap, run_mixed_gap
    from trellis_cli.kernel.abi import default_library
    from trellis_cli.kernel.build import build_jobs, kernels_for

    plan = plan_mixed_gap(request.source, request.synthetic, request.partition)  # its errors before the GPU's
    require_gpu()
    reporter.log(f"building or loading the kernel library for the {plan.preset.codebook} codebook ...")
    library = default_library(plan.preset.codebook, kernels=kernels_for(plan.preset.tier_k),
                              jobs=build_jobs(request.jobs), log=reporter.log)
    reporter.log(f"source: {plan.description}, with uniform "
                 + " and ".join(f"K{k}" for _, k in plan.kept) + " layers of the same shape")
    report = run_mixed_gap(plan, library, list(request.ms), cold=request.cold, replays=request.replays,
                           seed=request.seed, log=reporter.log)
    return TimingResult("mixed-gap", plan.description,
                        {"source": plan.description, "environment": environment(library), **report})


def _one_gpu(request: BenchRequest, reporter: BenchReporter, peer: Any) -> BenchResult:
    from trellis_cli.bench.environment import kernel_line
    from trellis_cli.bench.source import load_bench_source
    from trellis_cli.bench.synthetic import get_preset
    from trellis_cli.kernel.abi import default_library
    from trellis_cli.kernel.build import build_jobs, kernels_for
    from trellis_cli.kernel.plan import kernel_set

    require_gpu()
    bench = load_bench_source(request.source, synthetic=request.synthetic, partition=request.partition,
                              layer=request.layer, rank=request.rank, device="cuda", seed=request.seed)
    reporter.log(f"source: {bench.description}")
    reporter.log(f"building or loading the kernel library for the {bench.pack.codebook} codebook ...")
    # A synthetic --smoke also checks each of the preset's K alone: the kernel set covers them all.
    needed = kernels_for(get_preset(request.synthetic).tier_k) if request.synthetic else kernel_set(bench.pack)
    library = default_library(bench.pack.codebook, kernels=needed, jobs=build_jobs(request.jobs), log=reporter.log)
    reporter.log(kernel_line(library))
    if request.smoke:
        return _smoke(request, bench, library, reporter)
    return _throughput(request, bench, library, reporter, peer)


def _smoke(request: BenchRequest, bench: Any, library: Any, reporter: BenchReporter) -> SmokeResult:
    from trellis_cli.bench.environment import environment
    from trellis_cli.bench.smoke import run_smoke

    packs, reuse = smoke_packs(bench, request.synthetic, request.seed)
    checks = run_smoke(packs, library, seed=request.seed + 1, reuse_pack=reuse, log=reporter.log)
    document = {"source": bench.description, "environment": environment(library),
                "checks": [dataclasses.asdict(c) for c in checks], "passed": all(c.passed for c in checks)}
    return SmokeResult(checks, document)


def smoke_packs(bench: Any, synthetic: str | None, seed: int) -> tuple[list[tuple[str, Any]], Any]:
    """The layers --smoke checks: a preset at each of its K alone, mixed, and a second mixed split sharing the
    library (reuse); a SOURCE layer tier by tier, then whole."""
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
    views = [(f"tier {t} (K{k}) only", tier_view(bench.pack, t)) for t, k in enumerate(bench.pack.tier_k)]
    if len(views) < 2:
        return [("layer", bench.pack)], None
    return views + [("layer", bench.pack)], None


def tier_view(pack: Any, tier: int) -> Any:
    """The pack with every expert outside `tier` unmapped (served by nobody: contributes zero)."""
    import torch

    from trellis_cli.formats.layer_pack import split_descriptor

    g2c = pack.global_to_combined
    tiers = torch.where(g2c >= 0, split_descriptor(pack.descriptors[g2c.clamp(min=0).long()])[0], -1)
    return dataclasses.replace(pack, global_to_combined=torch.where(tiers == tier, g2c, -1).to(torch.int32))


def _throughput(request: BenchRequest, bench: Any, library: Any, reporter: BenchReporter,
                peer: Any) -> TimingResult:
    from trellis_cli.bench.environment import environment
    from trellis_cli.bench.throughput import TOP_K, run_throughput

    name = request.compare
    comparer = _build_peer(name, peer, min(TOP_K, int(bench.pack.global_to_combined.shape[0])), reporter)
    result = run_throughput(bench.pack, library, list(request.ms), cold=request.cold, replays=request.replays,
                            seed=request.seed + 1234, log=reporter.log,
                            compare=None if isinstance(comparer, str) else comparer)
    summary, wrong = peer_summary(name, comparer, result["rows"])
    failure = None
    if wrong:
        failure = (f"--compare {name}: its output disagrees with the float64 reference, so its time is not reported "
                   f"({'; '.join(wrong)}): the tensors given to it are not the layer's")
    return TimingResult("throughput", bench.description,
                        {"source": bench.description, "environment": environment(library), **result, **summary},
                        failure)


# ---- --compare PEER ---------------------------------------------------------------------------------------------

def _locate_peer(peer: str | None, reporter: BenchReporter) -> Any:
    """The peer's installation, or the reason it is skipped (said as a notice), or None without --compare.
    Cheap (nothing is imported), so it runs before the GPU check."""
    if peer is None:
        return None
    from trellis_cli.bench.peer_exllamav3 import locate_peer

    found = locate_peer()
    if isinstance(found, str):
        reporter.notice(_skip_notice(peer, found))
    return found


def _build_peer(peer: str | None, location: Any, top_k: int, reporter: BenchReporter) -> Any:
    """For `_locate_peer`'s answer: a PeerCompare on this GPU (the peer's first import builds its extension),
    or the reason it is skipped (said as a notice), or None without --compare."""
    if peer is None or isinstance(location, str):
        return location
    from trellis_cli.bench.peer_compare import PeerCompare
    from trellis_cli.bench.peer_exllamav3 import load_peer

    reporter.log(f"importing {peer}'s MoE layer (its first import builds its CUDA extension: minutes) ...")
    api = load_peer(location)
    if isinstance(api, str):
        reporter.notice(_skip_notice(peer, api))
        return api
    reporter.log(f"{peer} {api.version} imported")
    return PeerCompare(api, top_k, log=reporter.log)


def _skip_notice(peer: str, reason: str) -> str:
    return f"{peer} not importable: {reason}; skipping the comparison"


def peer_summary(peer: str | None, comparer: Any, rows: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The JSON's top-level `compare` (what ran, or why not) and the M's whose peer output was wrong."""
    if peer is None:
        return {}, []
    if isinstance(comparer, str):
        return {"compare": {"peer": peer, "skipped": comparer}}, []
    from trellis_cli.bench.peer_compare import disagreements

    return {"compare": {"peer": peer, "version": comparer.api.version, "skipped": None,
                        "ratio": f"{peer} µs / ours (above 1: ours is faster)"}}, disagreements(rows)

