"""`trellis bench --tp N` and `--device cpu`: argument checks before any rank starts, then the report."""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.cli import output
from trellis_cli.errors import CheckFailed, UsageError

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class TpRequest:
    source: str | None
    synthetic: str | None
    partition: str | None
    layer: int | None
    rank: int
    tp: int | None
    device: str
    ms: list[int]
    smoke: bool
    cold: bool
    replays: int
    seed: int
    as_json: bool


def wants_tp(tp: int | None, device: str) -> bool:
    """Whether `trellis bench` takes the tensor-parallel path (any --tp, or the CPU check)."""
    return tp is not None or device != "cuda"


def run_tp_bench(request: TpRequest) -> None:
    """Usage (exit 2), then the source's slicing (exit 2), then GPUs (exit 4): all before spawning."""
    from trellis_cli.bench.tp import TpJob, launched_rank, require_gpus, run_tp
    from trellis_cli.bench.tp_source import plan_tp_source

    tp = 1 if request.tp is None else request.tp
    _check_request(request, tp)
    launched = launched_rank()
    if launched is not None and launched.world != tp:
        raise UsageError(f"--tp {tp} but the launcher's WORLD_SIZE is {launched.world}")
    plan = plan_tp_source(request.source, synthetic=request.synthetic, partition=request.partition,
                          layer=request.layer, tp=tp, tp_given=request.tp is not None)
    if request.device == "cuda":
        require_gpus(tp, None if launched is None else launched.local_rank)
        from trellis_cli.kernel.abi import default_library

        output.log("building or loading the kernel library ...")
        default_library()  # built here once, so the ranks only load it
    output.log(f"source: {plan.description}, {tp} rank process(es) on {request.device}")
    job = TpJob(plan, request.device, request.smoke, tuple(request.ms), request.cold, request.replays,
                request.seed, output.state.quiet, output.state.debug)
    doc = run_tp(job)
    if doc is None:  # a launched rank other than 0: rank 0 reports
        return
    if request.smoke:
        _report_smoke(doc, request.as_json)
    elif request.as_json:
        output.emit_json(doc)
    else:
        _print_timing(doc)


def _check_request(request: TpRequest, tp: int) -> None:
    if tp < 1:
        raise UsageError(f"--tp {tp}: must be at least 1")
    if request.device not in DEVICES:
        raise UsageError(f"--device {request.device!r}: expected one of {', '.join(DEVICES)}")
    if request.device == "cpu" and not request.smoke:
        raise UsageError("--device cpu runs the check only (add --smoke); timing needs GPUs")
    if request.rank != 0:
        raise UsageError("--rank does not apply with --tp: every rank runs, one process each")


def _report_smoke(doc: dict, as_json: bool) -> None:
    from trellis_cli.bench.smoke import Check

    checks = [Check(**c) for c in doc["checks"]]
    failed = [c for c in checks if not c.passed]
    if as_json:
        output.emit_json(doc)
    else:
        output.print_checks(checks, "trellis bench --smoke")
    if failed:
        raise CheckFailed(f"smoke --tp {doc['tp']}: {len(failed)} of {len(checks)} checks FAILED")
    output.log(f"smoke --tp {doc['tp']}: all {len(checks)} checks passed (reference: {doc['reference']})")


def _print_timing(doc: dict) -> None:
    from rich.table import Table

    mode = "cold" if doc["cold"] else "warm"
    table = Table(title=output.cell(f"{doc['source']}, {mode} L2, all-reduce {doc['out_dtype']} over "
                                    f"{doc['backend']}"))
    for column in ("M", "kernel min µs", "kernel max µs", "all-reduce µs", "layer µs", "layer/kernel", "experts",
                   "graphs"):
        table.add_column(column, justify="right")
    for r in doc["rows"]:
        table.add_row(str(r["m"]), f"{r['kernel']['min_us']:.1f}", f"{r['kernel']['max_us']:.1f}",
                      f"{r['all_reduce']['median_us']:.1f}", f"{r['layer']['median_us']:.1f}",
                      f"{r['layer_over_max_kernel']:.2f}", str(r["experts"]), "yes" if r["graphs"] else "eager")
    output.stdout.print(table)
