"""`trellis bench --tp N`: N rank processes, one slice each, one torch.distributed process group.

Two ways in, one rank body (`run_rank`):
- spawned: torch.multiprocessing.spawn starts N processes; rank r takes GPU r; they meet over TCP on
  127.0.0.1 at a free port. Rank 0 writes its report into a private temporary directory that the parent
  reads after every rank has exited. With N = 1 this process is the one rank.
- launched: under torchrun, or anything else that sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
  MASTER_PORT, this process is one rank: it joins that group from the environment (rank LOCAL_RANK's GPU)
  and rank 0 returns the report; the other ranks return None.
The backend is NCCL with one GPU per rank, or gloo with device "cpu", where only the check runs (each rank's
forward being the float32 reference, tp_check.py). A rank's expected failure comes back to the parent as the
same error class with the rank named; a crash or a kill as one line naming the rank.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypedDict, cast

import torch
import torch.distributed as dist

from trellis_cli import errors
from trellis_cli.bench.tp_source import TpPlan, load_rank_pack
from trellis_cli.errors import CheckFailed, GpuUnavailable, TrellisError, UsageError

if TYPE_CHECKING:  # the timing modules load the kernel's launcher, which a CPU check does not need
    from trellis_cli.bench.tp_timing import TpTimingRow

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")  # all set: joined, not spawned
GROUP_TIMEOUT = timedelta(minutes=15)  # a rank waits this long for the others (rank 0's reference is slow)
RESULT_FILE = "result.json"
_ERROR_CLASSES = {cls.__name__: cls for cls in (errors.CheckFailed, errors.UsageError, errors.SourceUnavailable,
                                                errors.GpuUnavailable)}


@dataclass(frozen=True)
class TpJob:
    plan: TpPlan
    device: str  # "cuda" (NCCL, timing or smoke) or "cpu" (gloo, smoke only)
    smoke: bool
    ms: tuple[int, ...] = ()
    cold: bool = True
    replays: int = 100
    seed: int = 0
    quiet: bool = False
    debug: bool = False


@dataclass(frozen=True)
class LaunchedRank:
    rank: int
    world: int
    local_rank: int


def launched_rank(environ: Mapping[str, str] = os.environ) -> LaunchedRank | None:
    """This process's place in a launcher-made group, or None when no launcher set one up."""
    if not all(environ.get(name) for name in LAUNCH_VARS):
        return None
    if not environ.get("MASTER_PORT"):
        raise UsageError("RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR are set but MASTER_PORT is not")
    try:
        rank, world, local = (int(environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError:
        raise UsageError("RANK, WORLD_SIZE and LOCAL_RANK must be integers") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise UsageError(f"launcher environment: RANK {rank} is not in 0..WORLD_SIZE-1 ({world}) or LOCAL_RANK "
                         f"{local} is negative")
    return LaunchedRank(rank, world, local)


def require_gpus(count: int, local_rank: int | None = None) -> None:
    """GpuUnavailable (exit 4) unless this machine shows enough CUDA GPUs for one per rank."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = count if local_rank is None else local_rank + 1
    if visible < needed:
        what = f"--tp {count} needs {count} CUDA GPUs (one per rank)" if local_rank is None else \
            f"LOCAL_RANK {local_rank} needs GPU {local_rank}"
        raise GpuUnavailable(f"{what}, {visible} visible (--device cpu checks the slicing without GPUs)")


class _SmokeBody(TypedDict):
    environment: dict[str, Any]  # rank 0's GPU and library; {} on the CPU
    reference: str  # "whole layer" or "sum of rank slices"
    checks: list[dict[str, Any]]  # smoke.Check, as plain data
    passed: bool


class _TimingBody(TypedDict):
    environment: dict[str, Any]
    cold: bool
    out_dtype: str
    rows: list[TpTimingRow]  # per M: the slowest rank's kernel, all-reduce and layer times


class _TpHead(TypedDict):
    source: str
    tp: int
    backend: str  # gloo on the CPU, nccl on GPUs
    device: str


class TpReport(_TpHead, total=False):
    """Rank 0's report of a `--tp` run, the `--json` document: the head, then a smoke's or a timing's keys."""

    environment: dict[str, Any]
    reference: str  # smoke
    checks: list[dict[str, Any]]  # smoke
    passed: bool  # smoke
    cold: bool  # timing
    out_dtype: str  # timing
    rows: list[TpTimingRow]  # timing


def run_tp(job: TpJob) -> TpReport | None:
    """The report (rank 0 or the spawning parent) or None (another launched rank)."""
    launched = launched_rank()
    if launched is None and job.plan.tp == 1:  # a group of one needs no other process
        return run_rank(job, 0, 0, f"tcp://127.0.0.1:{_free_port()}")
    if launched is None:
        return _spawn(job)
    if launched.world != job.plan.tp:
        raise UsageError(f"--tp {job.plan.tp} but the launcher's WORLD_SIZE is {launched.world}")
    return run_rank(job, launched.rank, launched.local_rank, "env://")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spawn(job: TpJob) -> TpReport:
    from torch.multiprocessing import spawn
    from torch.multiprocessing.spawn import ProcessException

    # When one rank fails, torch stops the others and logs each stop; the failed rank's error says it all.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="trellis-tp-") as tmp:
        try:
            spawn(_spawned_rank, args=(job, _free_port(), tmp), nprocs=job.plan.tp, join=True)
        except ProcessException as err:
            raise _rank_failure(Path(tmp), err) from None
        result = Path(tmp) / RESULT_FILE
        if not result.is_file():
            raise CheckFailed("rank 0 ended without a report (interrupted?)")
        return cast(TpReport, json.loads(result.read_text(encoding="utf-8")))  # rank 0's run_rank, as JSON


def _spawned_rank(index: int, job: TpJob, port: int, tmp: str) -> None:
    try:
        doc = run_rank(job, index, index, f"tcp://127.0.0.1:{port}")
    except Exception as err:
        _write_failure(Path(tmp), index, err, job.debug)
        raise
    if doc is not None:
        staged = Path(tmp) / f"{RESULT_FILE}.partial"
        staged.write_text(json.dumps(doc), encoding="utf-8")
        staged.replace(Path(tmp) / RESULT_FILE)


def _write_failure(tmp: Path, rank: int, err: Exception, debug: bool) -> None:
    kind = type(err).__name__ if isinstance(err, TrellisError) else "internal"
    message = str(err) if isinstance(err, TrellisError) else f"{type(err).__name__}: {err}"
    if debug:
        traceback.print_exc(file=sys.stderr)
    doc = {"rank": rank, "kind": kind, "message": message}
    (tmp / f"error-{rank}.json").write_text(json.dumps(doc), encoding="utf-8")


def _rank_failure(tmp: Path, err: Exception) -> TrellisError:
    """The error to show for a failed run: a rank's own error first (peers that lost it fail after it)."""
    reports = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(tmp.glob("error-*.json"))]
    reports.sort(key=lambda r: (r["kind"] == "internal", r["rank"]))
    if not reports:
        return CheckFailed(f"a rank process ended abnormally: {err}")
    first = reports[0]
    if first["kind"] == "internal":
        return CheckFailed(f"rank {first['rank']}: internal error: {first['message']} (run with --debug for "
                           f"the traceback)")
    return _ERROR_CLASSES.get(first["kind"], CheckFailed)(f"rank {first['rank']}: {first['message']}")


def _rank_device(device: str, local_rank: int, world: int) -> torch.device:
    if device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads() // world))  # N ranks share the threads, not N× them
        return torch.device("cpu")
    gpu = torch.device("cuda", local_rank)
    torch.cuda.set_device(gpu)
    return gpu


def run_rank(job: TpJob, rank: int, local_rank: int, init_method: str) -> TpReport | None:
    """One rank's whole life: join the group, load its slice, check or time, leave. Rank 0 returns the report."""
    device = _rank_device(job.device, local_rank, job.plan.tp)
    backend = "gloo" if device.type == "cpu" else "nccl"
    extra: dict[str, Any] = {} if device.type == "cpu" else {"device_id": device}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=job.plan.tp,
                            timeout=GROUP_TIMEOUT, **extra)
    try:
        body: _SmokeBody | _TimingBody
        body = _rank_smoke(job, rank, device) if job.smoke else _rank_timing(job, rank, device)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    report: TpReport = {"source": job.plan.description, "tp": job.plan.tp, "backend": backend, "device": job.device,
                        **body}
    return report


def _log_for(job: TpJob, rank: int) -> Callable[[str], None]:
    def log(message: str) -> None:
        if rank == 0 and not job.quiet:
            print(message, file=sys.stderr, flush=True)

    return log


def _rank_smoke(job: TpJob, rank: int, device: torch.device) -> _SmokeBody:
    from trellis_cli.bench.tp_check import rank_smoke

    pack = load_rank_pack(job.plan, rank, device, seed=job.seed)
    runner, env = None, {}
    if device.type == "cuda":
        from trellis_cli.bench.environment import environment
        from trellis_cli.kernel.abi import default_library
        from trellis_cli.kernel.launch import FusedMoe

        runner = FusedMoe(pack, default_library(pack.codebook), device)
        env = environment(runner.library, device) if rank == 0 else {}
    checks = rank_smoke(job.plan, pack, runner, device, seed=job.seed + 1, log=_log_for(job, rank))
    failed = [c for c in checks if not c.passed]
    return {"environment": env, "reference": "whole layer" if job.plan.has_whole_layer else "sum of rank slices",
            "checks": [asdict(c) for c in checks], "passed": not failed}


def _rank_timing(job: TpJob, rank: int, device: torch.device) -> _TimingBody:
    from trellis_cli.bench.environment import environment
    from trellis_cli.bench.tp_timing import OUT_DTYPE, combine_ranks, rank_timing
    from trellis_cli.kernel.abi import default_library

    pack = load_rank_pack(job.plan, rank, device, seed=job.seed)
    library = default_library(pack.codebook)
    rows = rank_timing(pack, library, list(job.ms), cold=job.cold, replays=job.replays, seed=job.seed + 1234,
                       log=_log_for(job, rank))
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, rows)
    return {"environment": environment(library, device) if rank == 0 else {}, "cold": job.cold,
            "out_dtype": str(OUT_DTYPE).removeprefix("torch."), "rows": combine_ranks(per_rank, pack.hidden)}
