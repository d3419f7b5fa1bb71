"""`trellis repack EXL3 PACK` (`--to route-pack`): an exl3-v1 checkpoint -> a verified route-pack directory.

One (layer, rank) at a time, in order: the rank's slot extent is gathered into a LayerPack (pack.py, what
bench runs), written by the route pack's own writer (dialects/routepack/layer_file.py), then read back
(dialects/exl3v1/pack_readback.py) and compared with the source's bytes. Memory: one layer-rank. Any `--tp` the
slot layout allows (default as for `--to tr3`); `--layers` and `--ranks` select. config.json, tier_bitmap.json
and the carried files are the ones `--to tr3` writes (exl3v1_to_tr3.tr3_form) plus the route-pack note, and
each layer entry names the TR3 shard it goes back into (`tr3_shard`), so `repack PACK OUT --to tr3` writes
what `repack EXL3 OUT --to tr3` writes. A driver of the staged run (staged_run.py): staged in OUT.partial
(resumable), checked by verify_route_pack, then moved into place, as for a TR3 source.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.routepack import write as rp_write
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.exl3v1.container import container, parsed_manifest
from trellis_cli.dialects.exl3v1.pack import check_convertible, expert_tiers
from trellis_cli.dialects.exl3v1.pack_readback import check_written
from trellis_cli.dialects.exl3v1.exl3v1_to_tr3 import tr3_form
from trellis_cli.dialects.exl3v1.pack import checked_rates, default_tp, exl3v1_pack
from trellis_cli.dialects.routepack import manifest as mf
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME, layer_file_name
from trellis_cli.formats.layer_pack import tier_trellis_shape
from trellis_cli.dialects.routepack.layer_file import write_layer_pack
from trellis_cli.dialects.routepack.plan import LayerRankJob
from trellis_cli.selection import parse_selection
from trellis_cli.dialects.conversion import RepackResult, Validator
from trellis_cli.dialects.source_facts import SourceHashes, fingerprint, protected_paths
from trellis_cli.dialects.conversion import NOT_VALIDATED, Driver, OutputPlan, Progress
from trellis_cli.checkpoint.tensor_bytes import TensorReader
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.dialects.conversion import refuse_collisions

CONFIG = "config.json"


def pack_bytes(m, tiers: list[tuple[int, list[int]]], tp: int) -> int:
    """Tensor bytes of one layer file (the header is a few KB more)."""
    width, served = m.intermediate // tp, sum(len(ids) for _, ids in tiers)
    rows = served if m.per_expert_input_rotations else 1
    slabs = sum(2 * math.prod(tier_trellis_shape(len(ids), m.hidden, width, k)) for k, ids in tiers)
    return slabs + 4 * m.num_experts + 4 * served + 8 * len(tiers) + 2 * (served * 3 * width + 3 * rows * m.hidden)


class Exl3v1ToRoutePack(Driver):
    """exl3-v1 -> route pack, one (layer, rank) at a time (see the module docstring)."""

    def __init__(self, ck: Checkpoint, out: Path, options: Any, validator: Validator) -> None:
        if options.shared_h:
            raise UsageError("--shared-h does not apply to an exl3-v1 source: its hidden-side tables are kept as "
                             "stored ([H]: one row for every expert, [E, H]: one row per expert)")
        self.ck, self.out, self.opt = ck, out, options

    def plan(self) -> OutputPlan:
        ck, options = self.ck, self.opt
        box = container(ck)
        self.m = m = parsed_manifest(ck)
        self.tp = options.tp if options.tp is not None else default_tp(ck)
        check_convertible(m, self.tp)
        self.layers = parse_selection(options.layers, list(box.layers), "layers")
        self.ranks = parse_selection(options.ranks, list(range(self.tp)), "ranks")
        self.tiers = {li: expert_tiers(m, checked_rates(ck, li), li) for li in self.layers}
        self.form = tr3_form(ck, self.layers, self.tiers, self.tp, options.copy_other)
        self.jobs = [LayerRankJob(li, rank, layer_file_name(li, rank), pack_bytes(m, self.tiers[li], self.tp))
                     for li in self.layers for rank in self.ranks]
        layer_files = {box.layers[li].file for li in self.layers}
        self.used = sorted(layer_files | {box.manifest_file} | set(self.form.copy_from)
                           | ({CONFIG} if CONFIG in ck.files else set()))
        self.rotation = "per_expert" if m.per_expert_input_rotations else "shared_h"
        self.hashes = SourceHashes(ck)
        self._refuse_collisions()
        total = sum(job.bytes for job in self.jobs)
        carried = {n: max(ck.files.get(n, 0), 0) for n in self.form.copy_from}
        files: list[dict[str, Any]] = [{"name": job.file, "data_bytes": job.bytes} for job in self.jobs]
        files += [{"name": n, "bytes": size} for n, size in carried.items()]
        files += [{"name": n} for n in self.form.extra_json] + [{"name": CONFIG}, {"name": MANIFEST_NAME}]
        return OutputPlan(conversion=f"{ck.dialect} -> route-pack", out=self.out, protected=protected_paths(ck),
                          fingerprint={**fingerprint(ck, options, self.used), "tp": self.tp}, files=files,
                          bytes_needed=total + sum(carried.values()), progress_total=total,
                          selection={"layers": self.layers, "ranks": list(self.ranks), "tp": self.tp},
                          notes=[NOT_VALIDATED])

    def write(self, stage: StagedOutput, result: RepackResult, on_bytes: Progress) -> None:
        import torch  # noqa: F401 - imported once here, before the first layer-rank

        self.on_bytes = on_bytes
        self._write_layer_files(stage, result)
        result.manifest = self._finish(stage)

    def verify(self, tree: Path) -> None:
        from trellis_cli.dialects.routepack.verify import require_route_pack

        require_route_pack(tree, "the staged output", check_hashes=False)

    def _refuse_collisions(self) -> None:
        """Every name the pack writes belongs to one output (checked before any work)."""
        claims = rp_write.claims([(job.file, job.layer, job.rank) for job in self.jobs], [], [*self.form.copy_from, *self.form.extra_json])
        refuse_collisions(claims, [job.file for job in self.jobs] + [MANIFEST_NAME])

    def _sources(self, layer: int) -> dict[str, str]:
        """sha256 of what a layer file is made from: the layer's exl3-v1 file, read as the manifest says."""
        box = container(self.ck)
        return self.hashes.of({box.manifest_file, box.layers[layer].file})

    def _write_layer_files(self, stage: StagedOutput, result) -> None:
        box = container(self.ck)
        with TensorReader(self.ck.source) as reader:
            for job in self.jobs:
                if stage.completed(job.file, self._sources(job.layer)):
                    result.files_resumed += 1
                    self.on_bytes(job.bytes)
                    continue
                path = stage.file(job.file, f"the layer file of layer {job.layer} rank {job.rank}")
                pack = exl3v1_pack(self.ck, job.layer, job.rank, self.tp, reader)
                write_layer_pack(path, pack, on_bytes=self.on_bytes, durable=False)  # synced once in _finish
                del pack
                check_written(path, self.m, box.layers[job.layer], checked_rates(self.ck, job.layer), reader,
                              job.rank, self.tp, self.tiers[job.layer])
                size = path.stat().st_size
                stage.record(job.file, {"sha256": mf.sha256_file(path), "size": size, "layer": job.layer,
                                        "rank": job.rank}, self._sources(job.layer))
                result.files_written += 1
                result.bytes_written += size

    def _finish(self, stage: StagedOutput) -> dict[str, Any]:
        files = rp_write.copy_files(stage, self.form.copy_from, self.hashes.check_copy)
        files.update(rp_write.write_json_files(stage, self.form.extra_json))
        files[CONFIG] = rp_write.write_config(stage, self.form.config, self.tp, self.rotation)
        files.update({job.file: {k: stage.done[job.file][k] for k in ("sha256", "size", "layer", "rank")}
                      for job in self.jobs})
        ck = self.ck
        source = rp_write.source_record(ck.source, ck.dialect, ck.rotation_layout, ck.tp, self.form.vector_ndim,
                                        {n: {"sha256": self.hashes.get(n), "size": ck.files.get(n)} for n in self.used})
        doc = mf.base_document(source, self._geometry(), self.tp, self.ranks, "mcg", self.rotation)
        box = container(self.ck)
        for li in self.layers:
            doc["layers"][str(li)] = rp_write.layer_entry(self.tiers[li], [box.layers[li].file],
                                                          tr3_shard=self.form.shard_names[li])
        return rp_write.write_manifest(stage, doc, files, [job.file for job in self.jobs])

    def _geometry(self) -> dict[str, Any]:
        m = self.m
        return {"hidden": m.hidden, "intermediate": m.intermediate, "intermediate_rank": m.intermediate // self.tp,
                "num_experts": m.num_experts}


__all__ = ["Exl3v1ToRoutePack"]
