"""Compiler processes run side by side: at most `parallel` at once, each watched for a stall.

There is no wall-clock limit, since a slow or busy machine only takes longer. A job whose processes
(nvcc and the cicc, ptxas and gcc it starts, one process group) use no CPU time for `stall_s` seconds is
hung, and is killed and reported. CPU time is read from /proc; where there is no /proc nothing is
called a stall. Each job writes a temporary file that is moved into place only when the job succeeds;
a failure, a stall or an interrupt kills every running job and leaves no partial output behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from trellis_cli.errors import GpuUnavailable

POLL_S = 0.25
_LOG_LINES = 40


@dataclass
class Job:
    label: str  # names the job in progress lines and errors, e.g. "sm_90 unit mcg-mma16"
    command: list[str]
    tmp_output: Path  # what the command writes
    output: Path  # where it goes when the command succeeds
    keep_log: Path | None = None  # where the command's stdout and stderr go when it succeeds (None: dropped)


@dataclass
class _Running:
    job: Job
    proc: subprocess.Popen[bytes]
    log: IO[bytes]  # the job's stdout and stderr
    started: float
    cpu_ticks: int = -1
    last_progress: float = field(default_factory=time.monotonic)


def run_jobs(jobs: list[Job], *, parallel: int, stall_s: float,
             on_done: Callable[[Job, float], None] | None = None) -> None:
    """Run every job, `parallel` at a time, in list order; on_done(job, seconds) after each one."""
    pending, running = deque(jobs), list[_Running]()
    try:
        while pending or running:
            while pending and len(running) < max(1, parallel):
                running.append(_start(pending.popleft()))
            time.sleep(POLL_S)
            ticks = _group_cpu_ticks()
            for job in list(running):
                code = job.proc.poll()
                if code is None:
                    _check_stall(job, ticks, stall_s)
                    continue
                running.remove(job)
                _finish(job, code)
                if on_done:
                    on_done(job.job, time.monotonic() - job.started)
    finally:
        for job in running:
            _kill(job)


def _start(job: Job) -> _Running:
    log = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except OSError as err:
        log.close()
        raise GpuUnavailable(f"cannot run nvcc for {job.label}: {err}") from None
    return _Running(job, proc, log, time.monotonic())


def _check_stall(job: _Running, ticks: dict[int, int] | None, stall_s: float) -> None:
    now = time.monotonic()
    if ticks is None:  # no /proc: no stall detection
        job.last_progress = now
        return
    used = ticks.get(job.proc.pid, job.cpu_ticks)
    if used != job.cpu_ticks:
        job.cpu_ticks, job.last_progress = used, now
    elif now - job.last_progress > stall_s:
        _kill(job)
        raise GpuUnavailable(f"kernel build stalled: nvcc for {job.job.label} used no CPU time for "
                             f"{stall_s:.0f} s and was killed (TRELLIS_BUILD_STALL_S sets the limit)")


def _finish(job: _Running, code: int) -> None:
    try:
        if code != 0:
            job.log.seek(0)
            text = job.log.read().decode(errors="replace").strip()
            tail = "\n".join(text.splitlines()[-_LOG_LINES:])
            raise GpuUnavailable(f"kernel build failed for {job.job.label} (nvcc exit {code})\n{tail}")
        if job.job.keep_log is not None:
            job.log.seek(0)
            job.job.keep_log.write_bytes(job.log.read())
        os.replace(job.job.tmp_output, job.job.output)
    finally:
        job.log.close()
        job.job.tmp_output.unlink(missing_ok=True)


def _kill(job: _Running) -> None:
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)  # the session start_new_session made: nvcc and its children
    except (ProcessLookupError, PermissionError):
        pass
    job.proc.wait()
    job.log.close()
    job.job.tmp_output.unlink(missing_ok=True)


def _group_cpu_ticks() -> dict[int, int] | None:
    """CPU ticks used so far by each process group (live members, plus the children they have reaped)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    ticks: dict[int, int] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            stat = Path("/proc", name, "stat").read_bytes()
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(b")") + 2:].split()  # from field 3 (state) on: the name may hold spaces
        try:
            group, used = int(fields[2]), sum(int(f) for f in fields[11:15])  # pgrp; utime stime cutime cstime
        except (IndexError, ValueError):
            continue
        ticks[group] = ticks.get(group, 0) + used
    return ticks
