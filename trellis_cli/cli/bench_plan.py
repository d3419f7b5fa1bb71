"""`trellis bench --plan`: the launch plan of each --m for an arch, checked against its limits, with no GPU
and no build (exit 4 naming the arch, the limit and the kernel where nothing fits)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from trellis_cli.cli import output
from trellis_cli.errors import UsageError


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


def layer_geometry(source: str | None, synthetic: str | None, partition: str | None, layer: int | None,
                   rank: int) -> LayerGeometry:
    """A preset's geometry as it is (no weights made), or a SOURCE layer's, read on the CPU."""
    from trellis_cli.bench.source import choose_source, load_bench_source
    from trellis_cli.kernel.plan import kernel_set

    chosen = choose_source(source, synthetic, partition)
    if chosen is not None:
        preset, _ = chosen
        return LayerGeometry(f"synthetic {preset.name}", preset.hidden, preset.intermediate, preset.experts,
                             preset.experts, preset.top_k, preset.codebook, all(k in (3, 4) for k in preset.tier_k))
    bench = load_bench_source(source, synthetic=None, partition=None, layer=layer, rank=rank, device="cpu")
    pack = bench.pack
    experts = int(pack.global_to_combined.shape[0])
    return LayerGeometry(bench.description, pack.hidden, pack.intermediate, pack.num_combined, experts,
                         min(8, experts), pack.codebook, kernel_set(pack) == "k3k4")


def run_plan_check(geometry: LayerGeometry, arch: str | None, m_list: list[int], as_json: bool) -> None:
    import torch

    from trellis_cli.kernel.arch_limits import device_limits, limits_for_arch, override_limits
    from trellis_cli.kernel.build import cache_dir
    from trellis_cli.kernel.nvcc import has_wgmma
    from trellis_cli.kernel.plan import KernelDoesNotFit, make_plan
    from trellis_cli.kernel.resources import read_record, record_path

    if arch is None and not torch.cuda.is_available() and override_limits() is None:
        raise UsageError("--plan without a GPU needs --arch, e.g. --arch sm_120")
    limits = limits_for_arch(arch) if arch else device_limits()
    # The registers ptxas gave the kernels, where this arch's library of the codebook has been built here;
    # otherwise each kernel's launch-bounds budget, the most it may take.
    stem = f"trellis_moe{'_k3k4' if geometry.fast else ''}-{limits.arch}-{geometry.codebook}-"
    built = sorted(cache_dir().glob(f"{stem}*.so"), key=lambda p: p.stat().st_mtime)
    usage = read_record(record_path(built[-1])) if built else {}
    plans = []
    for m in m_list:
        try:
            plan = make_plan(m, geometry.top_k, geometry.hidden, geometry.intermediate, geometry.num_combined,
                             wgmma=limits.wgmma and has_wgmma(limits.arch), num_experts=geometry.num_experts, limits=limits,
                             codebook=geometry.codebook, fast=geometry.fast, usage=usage)
        except KernelDoesNotFit as err:
            raise KernelDoesNotFit(f"M={m}: {err}") from None
        plans.append(plan)
    if as_json:
        output.emit_json({"source": geometry.description, "limits": asdict(limits),
                          "registers_from": "ptxas" if usage else "launch bounds",
                          "plans": [asdict(p) for p in plans]})
        return
    output.print_line(f"{geometry.description}: plans for {limits.describe()} ({limits.source} limits; registers "
                      f"from {'ptxas' if usage else 'the launch bounds'})")
    for plan in plans:
        output.print_line(f"  M={plan.m}: {plan.describe()}")
