"""The staged, resumable run that writes a `--to tr3` output: what the output holds is the TR3 dialect's
writer (dialects/tr3/write.py, `Tr3Output`); this module owns OUT.partial, its lock, resume, the free-space
check and the move into place, and hands the writer the staged tree (`Stage`)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trellis_cli.dialects.tr3.write import Tr3Output
from trellis_cli.errors import CheckFailed
from trellis_cli.repack.lock import StageLock
from trellis_cli.repack.result import RepackResult
from trellis_cli.routepack import manifest as mf
from trellis_cli.routepack.source_bytes import TensorReader
from trellis_cli.repack.staging import (Stage, announce, check_free_space, check_target, refuse_collisions,
                                        refuse_overlap, stage_path)


class Tr3Run:
    """Staged, resumable writing of TR3 shards plus the JSON and copied files around them."""

    def __init__(self, out: Path, options, plan: Tr3Output, on_bytes, on_total, log) -> None:
        self.out, self.opt, self.plan = out, options, plan
        self.on_bytes = on_bytes or (lambda _n: None)
        self.on_total = on_total or (lambda _n: None)
        self.log = log or (lambda _m: None)

    def run(self):
        start = time.perf_counter()
        self.plan.refuse_unrepresentable()
        self.plan.narrow_declarations()
        refuse_collisions(self.plan.claims(), self.plan.all_shards())
        result = RepackResult(self.out)
        refuse_overlap(self.out, self.plan.source_root)
        with StageLock(stage_path(self.out), self.out):
            check_target(self.out, self.plan.source_root, self.opt.overwrite)
            stage = Stage(self.out, self.plan.fingerprint, self.opt.overwrite)
            announce(stage, self.log)
            result.bytes_needed = self.plan.bytes_to_write()
            try:
                check_free_space(self.out, result.bytes_needed - stage.bytes_done())
            except CheckFailed:
                stage.discard_if_new()
                raise
            self.on_total(result.bytes_needed)
            with stage.discard_on_refusal():
                self._write_all(stage, result)
                self.plan.final_check(stage.path)
            stage.move_into_place()
        result.seconds = time.perf_counter() - start
        return result

    def _write_all(self, stage: Stage, result) -> None:
        plan = self.plan
        weight_map: dict[str, str] = {}
        with TensorReader(plan.carried_source) as reader:
            for shard in plan.all_shards():
                sources = plan.sources(shard)
                if stage.completed(shard, sources):
                    result.files_resumed += 1
                    self.on_bytes(plan.shard_path(stage, shard).stat().st_size)
                else:
                    path = plan.write_shard(stage, shard, reader, self.on_bytes)
                    stage.record(shard, mf.file_entry(path), sources)
                    result.files_written += 1
                    result.bytes_written += path.stat().st_size
                weight_map.update(dict.fromkeys((t.name for t in plan.shard_tensors(shard)), shard))
        plan.write_rest(stage, weight_map)


def fingerprint_options(options) -> dict[str, Any]:
    return {k: getattr(options, k) for k in ("layers", "ranks", "tp", "shared_h", "to")}
