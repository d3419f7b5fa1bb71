"""TR3 -> route pack (`repack SRC OUT`, the default target): one layer file per (MoE layer, TP rank), streamed.

A driver of the staged run (staged_run.py). `write`: in a thread pool of `jobs` workers, pack -> write -> read
back and compare with the source -> record, one (layer, rank) per task (the reads release the GIL, so threads
overlap I/O and hashing); source files are hashed in the same pool. Then config.json (with a note), copied files,
the extra/ files of carried tensors and manifest.json. `verify`: the structural check of the whole directory.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.routepack import write as rp_write
from trellis_cli.errors import CheckFailed
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME
from trellis_cli.dialects.routepack.preflight import EXTRA_DIR, quick_plan, refuse_pack_collisions
from trellis_cli.dialects.routepack.readback import check_layer_file
from trellis_cli.dialects.conversion import RepackResult, Validator
from trellis_cli.dialects.source_facts import CONFIG, NOT_COPIED, SourceHashes, fingerprint, has_experts, protected_paths, used_source_files, vector_ndim
from trellis_cli.dialects.conversion import NOT_VALIDATED, Driver, OutputPlan, Progress
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.dialects import carry
from trellis_cli.dialects.routepack import manifest as mf
from trellis_cli.dialects.routepack.layer_file import write_layer_pack
from trellis_cli.dialects.shard_pack import Arena, layer_tiers, pack_layer
from trellis_cli.dialects.routepack.plan import LayerRankJob, RepackPlan, make_plan
from trellis_cli.checkpoint.tensor_bytes import TensorReader


class Tr3ToRoutePack(Driver):
    """A TR3 checkpoint (or another per-linear shard dialect of the table) -> a route pack."""

    plans_from_declarations = True  # quick_plan, held to plan() by tests/repack/test_dry_run_plan.py

    @classmethod
    def quick_plan(cls, ck: Checkpoint, out: Path, options: Any) -> OutputPlan | None:
        return quick_plan(ck, out, options)

    def __init__(self, checkpoint: Checkpoint, out: Path, options: Any, _validator: Validator | None = None) -> None:
        self.ck, self.out, self.opt = checkpoint, out, options
        self.on_bytes: Progress = lambda _n: None
        self.plan_: RepackPlan = make_plan(checkpoint, layers=options.layers, ranks=options.ranks, tp=options.tp,
                                           shared_h=self._output_shared())
        self.used = used_source_files(checkpoint, self.plan_.layers, options.copy_other)
        # Non-expert tensors of expert shards go to extra/<shard>; every other used file is copied as it is.
        self.carried = carry.non_expert_refs(checkpoint) if options.copy_other else {}
        self.copied = [n for n in self.used if n not in (CONFIG, *NOT_COPIED) and not has_experts(checkpoint, n)]
        self.hashes = SourceHashes(checkpoint)
        self.result = RepackResult(out)
        self._local = threading.local()
        self._counts = threading.Lock()  # worker threads add to the result's counters

    def _output_shared(self) -> bool:
        return bool(self.opt.shared_h) or self.ck.rotation_layout == "shared_h_v1"

    def plan(self) -> OutputPlan:
        """Every name checked to belong to one output; layer files by their tensor data (each header adds a few
        KB, inside the headroom), other files by their size."""
        refuse_pack_collisions([(job.file, job.layer, job.rank) for job in self.plan_.jobs], self.copied,
                               list(self.carried))
        layer_files: list[dict[str, Any]] = [{"name": job.file, "data_bytes": job.bytes} for job in self.plan_.jobs]
        other_files: list[dict[str, Any]] = [{"name": n, "bytes": max(self.ck.files.get(n, 0), 0)}
                                             for n in self.copied]
        other_files += [{"name": f"{EXTRA_DIR}/{n}", "bytes": carry.file_bytes(carry.planned(refs),
                                                                             self.ck.headers[n].metadata)}
                        for n, refs in self.carried.items()]
        return OutputPlan(
            conversion=f"{self.ck.dialect} -> route-pack", out=self.out, protected=protected_paths(self.ck),
            fingerprint=fingerprint(self.ck, self.opt, self.used),
            files=layer_files + other_files + [{"name": CONFIG}, {"name": MANIFEST_NAME}],  # the last two: small
            bytes_needed=self.bytes_to_write(), progress_total=self.plan_.total_bytes,
            selection={"layers": self.plan_.layers, "ranks": list(self.plan_.ranks), "tp": self.plan_.target_tp},
            notes=[NOT_VALIDATED])

    def write(self, stage: StagedOutput, result: RepackResult, on_bytes: Progress) -> None:
        import torch  # noqa: F401 - imported once here, not concurrently by the first workers

        self.result, self.on_bytes = result, on_bytes
        self._run_jobs(stage)
        result.manifest = self._finish(stage)

    def verify(self, tree: Path) -> None:
        from trellis_cli.dialects.routepack.verify import require_route_pack

        require_route_pack(tree, "the staged output", check_hashes=False)

    def bytes_to_write(self) -> int:
        """Every byte the pack will hold: layer files, copied files, and the extra/ files of carried tensors."""
        copied = sum(max(self.ck.files.get(n, 0), 0) for n in self.copied)
        extras = sum(carry.file_bytes(carry.planned(refs), self.ck.headers[n].metadata)
                     for n, refs in self.carried.items())
        return self.plan_.total_bytes + copied + extras

    def _run_jobs(self, stage: StagedOutput) -> None:
        with TensorReader(self.ck.source) as reader, ThreadPoolExecutor(self.opt.jobs) as pool:
            futures: list[Future[Any]] = []
            for name in self._hash_order()[0]:
                futures.append(pool.submit(self.hashes.get, name))
            for layer, files in zip(self.plan_.layers, self._hash_order()[1]):
                for job in (j for j in self.plan_.jobs if j.layer == layer):
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
            # The first failed task in submission order (a set's order would pick one by memory address).
            for future in (f for f in futures if f in done):
                error = future.exception()
                if error is not None:
                    for other in futures:
                        other.cancel()
                    raise error

    def _hash_order(self) -> tuple[list[str], list[list[str]]]:
        """Source files to hash: those of no selected layer first (small JSON files), then per layer."""
        seen: set[str] = set()
        per_layer = []
        for layer in self.plan_.layers:
            files = [f for f in sorted(self.ck.layers[layer].files) if f in self.used and f not in seen]
            seen.update(files)
            per_layer.append(files)
        return [f for f in self.used if f not in seen], per_layer

    def _next_files(self, layer: int) -> list[str]:
        later = [li for li in self.plan_.layers if li > layer]
        return sorted(self.ck.layers[later[0]].files) if later else []

    def _resume_or_redo(self, job: LayerRankJob, stage: StagedOutput, reader: TensorReader) -> None:
        """A staged file is reused only when the source files it came from still hash to what it recorded."""
        if stage.completed(job.file, self.hashes.of(self.ck.layers[job.layer].files)):
            with self._counts:
                self.result.files_resumed += 1
            self.on_bytes(job.bytes)
            return
        self._layer_job(job, stage, reader)

    def _layer_job(self, job: LayerRankJob, stage: StagedOutput, reader: TensorReader) -> None:
        for file in self._next_files(job.layer):  # overlap the next layer's disk reads with this one's work
            reader.prefetch(file)
        arena = getattr(self._local, "arena", None) or Arena()
        self._local.arena = arena  # one per worker thread: peak memory = jobs x one layer-rank
        pack = pack_layer(self.ck, job.layer, job.rank, tp=self.plan_.target_tp,
                          shared_h=True if self.opt.shared_h else None, reader=reader, arena=arena)
        path = stage.file(job.file, f"the layer file of layer {job.layer} rank {job.rank}")
        write_layer_pack(path, pack, on_bytes=self.on_bytes, durable=False)  # synced once in _finish
        del pack
        digest = check_layer_file(path, self.ck, job.layer, job.rank, tp=self.plan_.target_tp,
                                  shared_h=self.plan_.shared_h, reader=reader)
        size = path.stat().st_size
        stage.record(job.file, {"sha256": digest, "size": size, "layer": job.layer, "rank": job.rank},
                     self.hashes.of(self.ck.layers[job.layer].files))
        with self._counts:  # `+=` on shared counters is not atomic across threads
            self.result.files_written += 1
            self.result.bytes_written += size

    def _finish(self, stage: StagedOutput) -> dict[str, Any]:
        ck, plan = self.ck, self.plan_
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
        for layer in self.plan_.layers:
            for projs in self.ck.layers[layer].experts.values():
                for ranks in projs.values():
                    for lin in ranks.values():
                        return lin.codebook
        return self.ck.codebook or "mcg"

    def _copy_other(self, stage: StagedOutput) -> dict[str, dict[str, Any]]:
        """Copied files verbatim (checked against the source's sha256); carried tensors into extra/<file>."""
        entries = rp_write.copy_files(stage, {n: self.ck.source.local_path(n) for n in self.copied}, self._check_copy)
        with TensorReader(self.ck.source) as reader:
            entries.update(rp_write.write_extras(stage, self.carried, reader,
                                                 {n: self.ck.headers[n].metadata for n in self.carried}))
        return entries

    def _check_copy(self, name: str, copy: Path) -> None:
        if mf.sha256_file(copy) != self.hashes.get(name):
            raise CheckFailed(f"{name}: the copy differs from the source file (did it change during the repack?)")



__all__ = ["Tr3ToRoutePack"]
