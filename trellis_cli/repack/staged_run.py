"""The one staged run every repack conversion goes through, and its dry run.

A conversion is a `Driver` (dialects/conversion.py; drivers.py picks it from the dialect registry's conversion
table, and it lives in its dialect's package): `plan()` says what
it would write (every file, the bytes the output holds, the fingerprint a resumed stage must match) and raises
every refusal known before work; `write(stage)` writes into the staged tree (OUT.partial) and reads each file
back; `verify(tree)` checks the finished tree as a whole. This module alone owns what is around them: the target
check, the free space, the lock, the stage (resume), and the move into place. `--dry-run` is `plan()` plus the
same target, lock-file and free-space checks, answered as a document instead of written, so a dry run and the
real run refuse the same things with the same words.

Order of a real run: plan -> OUT, the lock file and free space (before the slow source validation) -> the source
validation -> the driver's data checks -> the lock -> OUT again, the stage, free space less what is staged ->
write -> verify -> move into place.
"""

from __future__ import annotations

import time
from typing import Callable, cast

from trellis_cli.dialects.conversion import Driver, DryRunPlan, OutputPlan, Progress, RepackResult
from trellis_cli.disk_space import free_bytes, space_refusal
from trellis_cli.errors import CheckFailed
from trellis_cli.id_ranges import compact_ranges
from trellis_cli.repack.lock import StageLock
from trellis_cli.repack.staging import (Stage, announce, check_target, refuse_overlap, resumable_bytes,
                                        stage_path)


def plan_document(plan: OutputPlan, resumable: int) -> DryRunPlan:
    """The dry run's answer: what would be written, the free space, and the refusals a real run would make."""
    out = plan.out
    free = free_bytes(out)
    refusal = space_refusal(out, free, plan.bytes_needed - resumable, "the repack")
    selection = dict(plan.selection)
    if "layers" in selection:
        selection["layers"] = compact_ranges(selection["layers"])
    # cast: the selection's keys are the driver's (layers, ranks, tp), checked by DryRunPlan's readers, not here
    return cast(DryRunPlan, {"conversion": plan.conversion, "out": str(out), **selection, "files": plan.files,
                             "bytes_needed": plan.bytes_needed, "bytes_resumable": resumable, "free_bytes": free,
                             "space_ok": refusal is None, "refusals": [refusal] if refusal else [],
                             "notes": plan.notes})


def check_before_work(plan: OutputPlan, overwrite: bool) -> DryRunPlan:
    """OUT, the lock file and free space as they stand now (refusals of OUT and the lock raise): the dry run's
    document, and the real run's refusal before the slow part."""
    check_target(plan.out, plan.protected, overwrite)  # the lock file's refusals included
    return plan_document(plan, resumable_bytes(plan.out, plan.fingerprint))


def dry_run(driver: Driver, overwrite: bool) -> RepackResult:
    plan = driver.planned()
    driver.data_checks()
    result = RepackResult(plan.out)
    result.plan = check_before_work(plan, overwrite)
    result.bytes_needed = plan.bytes_needed
    return result


def run_staged(driver: Driver, overwrite: bool, *, check_source: Callable[[], None] | None = None,
               on_bytes: Progress | None = None, on_total: Progress | None = None,
               log: Callable[[str], None] | None = None) -> RepackResult:
    """The real run (see the module docstring). `check_source` validates the source (raises when it may not
    be repacked); None skips it."""
    start = time.perf_counter()
    plan = driver.planned()
    refusals = check_before_work(plan, overwrite)["refusals"]
    if refusals:
        raise CheckFailed(refusals[0])
    if check_source is not None:
        check_source()
    driver.data_checks()
    out = plan.out
    result = RepackResult(out)
    refuse_overlap(out, plan.protected)
    with StageLock(stage_path(out), out):
        check_target(out, plan.protected, overwrite)
        stage = Stage(out, plan.fingerprint, overwrite)
        announce(stage, log or (lambda _m: None))
        result.bytes_needed = plan.bytes_needed
        refusal = space_refusal(out, free_bytes(out), plan.bytes_needed - stage.bytes_done(), "the repack")
        if refusal:
            stage.discard_if_new()
            raise CheckFailed(refusal)
        (on_total or (lambda _n: None))(plan.progress_total)
        with stage.discard_on_refusal():
            driver.write(stage, result, on_bytes or (lambda _n: None))
            driver.verify(stage.path)
        stage.move_into_place()
    result.seconds = time.perf_counter() - start
    return result


__all__ = ["check_before_work", "dry_run", "plan_document", "run_staged"]
