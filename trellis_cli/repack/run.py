"""`run_repack`: a TR3 checkpoint -> a verified route-pack directory, streamed one layer-rank at a time.

Order of work: open and validate the source; plan; check OUT and free space; then, in a thread pool of
`jobs` workers, pack -> write -> read back and compare with the source -> record, one (layer, rank) per
task (the reads release the GIL, so threads overlap I/O and hashing). Source files are hashed in the same
pool. Then config.json (with a note), copied-through files, manifest.json, a structural check of the whole
directory, and the move from OUT.partial into place. `--to tr3` is delegated to convert.py.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import byte_faults
from trellis_cli.dialects.routepack import write as rp_write
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.routepack import carry
from trellis_cli.routepack.layer_file import write_layer_pack
from trellis_cli.repack.lock import StageLock
from trellis_cli.repack.preflight import (EXTRA_DIR, NOT_VALIDATED, quick_dry_run, refuse_pack_collisions,
                                          route_pack_plan, unplanned_dry_run)
from trellis_cli.routepack.pack import Arena, layer_tiers, pack_layer
from trellis_cli.routepack.plan import LayerRankJob, RepackPlan, make_plan
from trellis_cli.repack.readback import check_layer_file
from trellis_cli.repack.result import RepackResult, Validator, check_source
from trellis_cli.routepack.source_bytes import TensorReader
from trellis_cli.repack.source_facts import (CONFIG, NOT_COPIED, SourceHashes, fingerprint, has_experts,
                                             protected_paths, used_source_files, vector_ndim)
from trellis_cli.repack.staging import (Stage, announce, check_free_space, check_target,
                                        refuse_overlap, resumable_bytes, stage_path)
from trellis_cli.routepack import manifest as mf



@dataclass
class RepackOptions:
    layers: list[int] | None = None  # [3, 4, 5, 40] (a "3-5,40" text is parsed once, here)
    ranks: list[int] | None = None  # [0, 1] (of the target TP)
    tp: int | None = None  # target TP; None keeps the source's
    shared_h: bool = False  # collapse hidden-side rows to [1, H] (refused unless byte-equal)
    to: str = "route-pack"  # a conversion target of the dialect registry: route-pack, tr3, exl3-v1
    jobs: int = 1
    overwrite: bool = False
    copy_other: bool = True  # carry non-expert files and tensors through
    validate: bool = True
    dry_run: bool = False  # plan and check (OUT, names, free space), write nothing, skip the source validation

    def __post_init__(self) -> None:
        """Typed once: a `--layers` / `--ranks` text becomes the id list every driver reads."""
        from trellis_cli.selection import parse_layer_ranges

        for name in ("layers", "ranks"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, parse_layer_ranges(value, option=f"--{name}") if value.strip() else None)


def open_repack_source(source: Any, progress: Callable[[str, int, int], None] | None = None) -> Checkpoint:
    from trellis_cli.dialects.open import open_checkpoint

    return open_checkpoint(source, progress=progress)


def run_repack(source: Any, out: str | Path, options: RepackOptions | None = None, *, validator: Validator,
               on_bytes: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None,
               log: Callable[[str], None] | None = None,
               on_stage: Callable[[str, int, int], None] | None = None) -> RepackResult:
    """Repack `source` (a Source, a path, or an opened Checkpoint) into `out`; see the module docstring.

    `validator` decides whether the source may be repacked (with `options.validate`) and whether a staged
    exl3-v1 output is sound: `trellis_cli.run_repack` passes validate.run_validation. `on_stage(stage, done,
    total)` follows the opening of the source (headers, model)."""
    options = options or RepackOptions()
    log = log or (lambda _m: None)
    from trellis_cli.dialects import registry

    if options.to not in registry.targets():
        raise UsageError(f"--to {options.to!r}: expected {', '.join(registry.targets())}")
    if options.jobs < 1:
        raise UsageError(f"--jobs {options.jobs}: must be at least 1")
    from trellis_cli.routepack.manifest import is_route_pack

    root = _local_root(source)
    if root is not None and not isinstance(source, Checkpoint) and not is_route_pack(root):
        # Planned from declarations, file sizes and names in the raw headers, seconds before the opening: the
        # dry run's answer, and a real run's refusal (no space, OUT, a name claimed twice) before the slow part.
        quick = quick_dry_run(source, Path(out), options)
        if quick is not None and options.dry_run:
            return quick
        if quick is not None and quick.plan and quick.plan["refusals"]:
            raise CheckFailed(quick.plan["refusals"][0])
    if root is not None and is_route_pack(root):
        if options.dry_run:
            return unplanned_dry_run(Path(out), options, "route-pack", root, options.overwrite)
        from trellis_cli.repack.convert import route_pack_to_tr3

        converted: RepackResult = route_pack_to_tr3(root, Path(out), options, on_bytes=on_bytes, on_total=on_total,
                                                    log=log, validator=validator)
        return converted
    checkpoint = source if isinstance(source, Checkpoint) else open_repack_source(source, on_stage)
    driver = registry.conversion(checkpoint.dialect, options.to)  # the table keyed by (from, to)
    if driver is None:
        raise UsageError(_no_conversion(checkpoint.dialect, options.to))
    from trellis_cli.repack.exl3v1 import dispatch as exl3v1_repack  # exl3-v1 in or out: its own drivers

    if driver in exl3v1_repack.DRIVERS:
        if options.dry_run:
            return unplanned_dry_run(Path(out), options, checkpoint.dialect, protected_paths(checkpoint),
                                     options.overwrite)
        result: RepackResult = exl3v1_repack.run_exl3v1_repack(driver, checkpoint, Path(out), options, validator,
                                                               on_bytes=on_bytes, on_total=on_total, log=log)
        return result
    if driver == "route-pack-to-tr3":  # a route pack converts back from a local directory (above)
        raise UsageError("a route pack converts back to TR3 from a local directory only")
    run = None
    if driver == "tr3-to-route-pack":
        # OUT, option conflicts, name collisions and free space are known from headers: refused here, before
        # the source's validation (tens of seconds on a production checkpoint).
        try:
            run = _RoutePackRun(checkpoint, Path(out), options, on_bytes, on_total, log)
        except UsageError:
            if options.dry_run or not options.validate or not any(byte_faults(checkpoint)):
                raise
            run = None  # a file that cannot be read, not a layer "not in the source": the validation names it
        except Exception:  # a source the plan cannot read: its validation below names what is wrong
            run = None
        if run is not None:
            preflight = run.preflight()
            if options.dry_run:
                run.result.plan = preflight
                return run.result
    if options.dry_run:
        return unplanned_dry_run(Path(out), options, checkpoint.dialect, protected_paths(checkpoint),
                                 options.overwrite)
    if options.validate:
        check_source(checkpoint, validator)
    import torch  # noqa: F401 - imported once here, not concurrently by the first workers
    if driver == "tr3-to-tr3":
        from trellis_cli.repack.convert import tr3_to_tr3

        resliced: RepackResult = tr3_to_tr3(checkpoint, Path(out), options, on_bytes=on_bytes, on_total=on_total,
                                            log=log)
        return resliced
    return (run or _RoutePackRun(checkpoint, Path(out), options, on_bytes, on_total, log)).run()


def _no_conversion(source: str, target: str) -> str:
    from trellis_cli.dialects import registry

    reachable = [t for t in registry.targets() if registry.conversion(source, t) is not None]
    instead = f"; from {source}: --to {' or --to '.join(reachable)}" if reachable else ""
    return (f"--to {target} reads {', '.join(registry.sources_of(target))} checkpoints; the source is "
            f"{source}{instead}")


def _local_root(source: Any) -> Path | None:
    if isinstance(source, (str, Path)):
        return Path(source) if Path(source).is_dir() else None
    if isinstance(source, Checkpoint):
        source = source.source
    root = getattr(source, "root", None)
    return Path(root) if isinstance(root, (str, Path)) else None


class _RoutePackRun:
    def __init__(self, checkpoint: Checkpoint, out: Path, options: RepackOptions,
                 on_bytes: Callable[[int], None] | None, on_total: Callable[[int], None] | None,
                 log: Callable[[str], None]) -> None:
        self.ck, self.out, self.opt = checkpoint, out, options
        self.on_bytes = on_bytes or (lambda _n: None)
        self.on_total = on_total or (lambda _n: None)
        self.log = log
        self.plan: RepackPlan = make_plan(checkpoint, layers=options.layers, ranks=options.ranks, tp=options.tp,
                                          shared_h=self._output_shared())
        self.used = used_source_files(checkpoint, self.plan.layers, options.copy_other)
        # Non-expert tensors of expert shards go to extra/<shard>; every other used file is copied as it is.
        self.carried = carry.non_expert_refs(checkpoint) if options.copy_other else {}
        self.copied = [n for n in self.used if n not in (CONFIG, *NOT_COPIED) and not has_experts(checkpoint, n)]
        self.hashes = SourceHashes(checkpoint)
        self.result = RepackResult(out)
        self._local = threading.local()
        self._counts = threading.Lock()  # worker threads add to the result's counters

    def _output_shared(self) -> bool:
        return self.opt.shared_h or self.ck.rotation_layout == "shared_h_v1"

    def refuse_collisions(self) -> None:
        """Every name this pack writes belongs to exactly one output (checked before any work)."""
        refuse_pack_collisions([(job.file, job.layer, job.rank) for job in self.plan.jobs], self.copied,
                               list(self.carried))

    def preflight(self) -> dict[str, Any]:
        """What this run would write, checked before any work: names, OUT and free space (refusals raise).

        Reads nothing but what the plan already knows and OUT.partial's record; writes nothing."""
        self.refuse_collisions()
        check_target(self.out, protected_paths(self.ck), self.opt.overwrite)
        needed = self.bytes_to_write()
        resumable = resumable_bytes(self.out, fingerprint(self.ck, self.opt, self.used))
        # Layer files: their tensor data (each header adds a few KB, inside the headroom); others: their size.
        layer_files = [{"name": job.file, "data_bytes": job.bytes} for job in self.plan.jobs]
        other_files = [{"name": n, "bytes": max(self.ck.files.get(n, 0), 0)} for n in self.copied]
        other_files += [{"name": f"{EXTRA_DIR}/{n}", "bytes": carry.file_bytes(carry.planned(refs),
                                                                             self.ck.headers[n].metadata)}
                        for n, refs in self.carried.items()]
        plan = route_pack_plan(self.out, self.opt, self.ck.dialect, layer_files, other_files, needed, resumable,
                               layers=self.plan.layers, ranks=self.plan.ranks, tp=self.plan.target_tp,
                               notes=[NOT_VALIDATED])
        if plan["refusals"] and not self.opt.dry_run:
            raise CheckFailed(plan["refusals"][0])
        return plan

    def run(self) -> RepackResult:
        start = time.perf_counter()
        self.refuse_collisions()
        refuse_overlap(self.out, protected_paths(self.ck))
        with StageLock(stage_path(self.out), self.out):
            check_target(self.out, protected_paths(self.ck), self.opt.overwrite)
            stage = Stage(self.out, fingerprint(self.ck, self.opt, self.used), self.opt.overwrite)
            announce(stage, self.log)
            self.result.bytes_needed = self.bytes_to_write()
            try:
                check_free_space(self.out, self.result.bytes_needed - stage.bytes_done())
            except CheckFailed:
                stage.discard_if_new()
                raise
            self.on_total(self.plan.total_bytes)
            with stage.discard_on_refusal():
                self._run_jobs(stage)
                doc = self._finish(stage)
                from trellis_cli.dialects.routepack.verify import verify_repacked

                report = verify_repacked(stage.path, check_hashes=False)
                if not report.ok:
                    raise CheckFailed(f"{stage.path}: the staged output does not verify: {report.errors[0].line()}")
            stage.move_into_place()
        self.result.manifest = doc
        self.result.seconds = time.perf_counter() - start
        return self.result

    def bytes_to_write(self) -> int:
        """Every byte the pack will hold: layer files, copied files, and the extra/ files of carried tensors."""
        copied = sum(max(self.ck.files.get(n, 0), 0) for n in self.copied)
        extras = sum(carry.file_bytes(carry.planned(refs), self.ck.headers[n].metadata)
                     for n, refs in self.carried.items())
        return self.plan.total_bytes + copied + extras

    def _run_jobs(self, stage: Stage) -> None:
        with TensorReader(self.ck.source) as reader, ThreadPoolExecutor(self.opt.jobs) as pool:
            futures: list[Future[Any]] = []
            for name in self._hash_order()[0]:
                futures.append(pool.submit(self.hashes.get, name))
            for layer, files in zip(self.plan.layers, self._hash_order()[1]):
                for job in (j for j in self.plan.jobs if j.layer == layer):
                    task = self._resume_or_redo if job.file in stage.done else self._layer_job
                    futures.append(pool.submit(task, job, stage, reader))
                # Right after the layer's own jobs: its shard is in the page cache, and with --jobs > 1 the
                # hashing overlaps the next layer's disk reads.
                futures += [pool.submit(self.hashes.get, name) for name in files]
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            except BaseException:  # Ctrl-C: stop queued jobs; the running ones finish their file
                for future in futures:
                    future.cancel()
                raise
            for future in done:
                error = future.exception()
                if error is not None:
                    for other in futures:
                        other.cancel()
                    raise error

    def _hash_order(self) -> tuple[list[str], list[list[str]]]:
        """Source files to hash: those of no selected layer first (small JSON files), then per layer."""
        seen: set[str] = set()
        per_layer = []
        for layer in self.plan.layers:
            files = [f for f in sorted(self.ck.layers[layer].files) if f in self.used and f not in seen]
            seen.update(files)
            per_layer.append(files)
        return [f for f in self.used if f not in seen], per_layer

    def _next_files(self, layer: int) -> list[str]:
        later = [li for li in self.plan.layers if li > layer]
        return sorted(self.ck.layers[later[0]].files) if later else []

    def _resume_or_redo(self, job: LayerRankJob, stage: Stage, reader: TensorReader) -> None:
        """A staged file is reused only when the source files it came from still hash to what it recorded."""
        if stage.completed(job.file, self.hashes.of(self.ck.layers[job.layer].files)):
            with self._counts:
                self.result.files_resumed += 1
            self.on_bytes(job.bytes)
            return
        self._layer_job(job, stage, reader)

    def _layer_job(self, job: LayerRankJob, stage: Stage, reader: TensorReader) -> None:
        for file in self._next_files(job.layer):  # overlap the next layer's disk reads with this one's work
            reader.prefetch(file)
        arena = getattr(self._local, "arena", None) or Arena()
        self._local.arena = arena  # one per worker thread: peak memory = jobs x one layer-rank
        pack = pack_layer(self.ck, job.layer, job.rank, tp=self.plan.target_tp,
                          shared_h=True if self.opt.shared_h else None, reader=reader, arena=arena)
        path = stage.file(job.file, f"the layer file of layer {job.layer} rank {job.rank}")
        write_layer_pack(path, pack, on_bytes=self.on_bytes, durable=False)  # synced once in _finish
        del pack
        digest = check_layer_file(path, self.ck, job.layer, job.rank, tp=self.plan.target_tp,
                                  shared_h=self.plan.shared_h, reader=reader)
        size = path.stat().st_size
        stage.record(job.file, {"sha256": digest, "size": size, "layer": job.layer, "rank": job.rank},
                     self.hashes.of(self.ck.layers[job.layer].files))
        with self._counts:  # `+=` on shared counters is not atomic across threads
            self.result.files_written += 1
            self.result.bytes_written += size

    def _finish(self, stage: Stage) -> dict[str, Any]:
        ck, plan = self.ck, self.plan
        files = self._copy_other(stage)
        files[CONFIG] = rp_write.write_config(stage, ck.config, plan.target_tp,
                                              "shared_h" if plan.shared_h else "per_expert")
        source = rp_write.source_record(ck.source, ck.dialect, ck.rotation_layout, ck.tp, vector_ndim(ck),
                                        {n: {"sha256": self.hashes.get(n), "size": ck.files.get(n)} for n in self.used})
        assert ck.intermediate is not None  # make_plan refused a source without one
        geometry = {"hidden": ck.hidden, "intermediate": ck.intermediate,
                    "intermediate_rank": ck.intermediate // plan.target_tp, "num_experts": ck.num_experts}
        codebook = self._codebook()
        doc = mf.base_document(source, geometry, plan.target_tp, plan.ranks, codebook,
                               "shared_h" if plan.shared_h else "per_expert")
        for layer in plan.layers:
            doc["layers"][str(layer)] = rp_write.layer_entry(layer_tiers(ck, layer), sorted(ck.layers[layer].files))
        files.update({job.file: {k: stage.done[job.file][k] for k in ("sha256", "size", "layer", "rank")}
                      for job in plan.jobs})
        return rp_write.write_manifest(stage, doc, files, [job.file for job in plan.jobs])

    def _codebook(self) -> str:
        for layer in self.plan.layers:
            for projs in self.ck.layers[layer].experts.values():
                for ranks in projs.values():
                    for lin in ranks.values():
                        return lin.codebook
        return self.ck.codebook or "mcg"

    def _copy_other(self, stage: Stage) -> dict[str, dict[str, Any]]:
        """Copied files verbatim (checked against the source's sha256); carried tensors into extra/<file>."""
        entries = rp_write.copy_files(stage, {n: self.ck.source.local_path(n) for n in self.copied}, self._check_copy)
        with TensorReader(self.ck.source) as reader:
            entries.update(rp_write.write_extras(stage, self.carried, reader,
                                                 {n: self.ck.headers[n].metadata for n in self.carried}))
        return entries

    def _check_copy(self, name: str, copy: Path) -> None:
        if mf.sha256_file(copy) != self.hashes.get(name):
            raise CheckFailed(f"{name}: the copy differs from the source file (did it change during the repack?)")


__all__ = ["RepackOptions", "run_repack"]
