"""`trellis repack TR3 OUT --to exl3-v1`: rank-sliced TR3 -> one exl3-v1 layer file per MoE layer.

A driver of the staged run (staged_run.py). What the exl3-v1 output holds and how each layer file is made from
the TR3 ranks and read back is the exl3-v1 dialect's (dialects/exl3v1/from_tr3.py); this driver plans the
files, carries the files around the experts (exl3v1_carry.py), records the source hashes, writes the manifest
last and validates the finished tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.exl3v1.from_tr3 import check_hidden_side_equal, target_manifest, write_converted_layer
from trellis_cli.dialects.exl3v1.pack import NOTE_KEY
from trellis_cli.dialects.exl3v1.schema import MANIFEST_FILE, LayerEntry
from trellis_cli.dialects.exl3v1.write import layer_file_name, write_manifest
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.exl3v1.carry import carried_files, write_carried
from trellis_cli.dialects.conversion import RepackResult, Validator
from trellis_cli.dialects.source_facts import SourceHashes, protected_paths, vector_ndim
from trellis_cli.dialects.conversion import NOT_VALIDATED, Driver, OutputPlan, Progress
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.dialects.conversion import refuse_collisions
from trellis_cli.dialects.routepack.manifest import file_entry
from trellis_cli.dialects.shard_pack import layer_tiers
from trellis_cli.selection import parse_selection


class Tr3ToExl3v1(Driver):
    """TR3 -> exl3-v1, one layer file per selected MoE layer (see the module docstring)."""

    def __init__(self, ck: Checkpoint, out: Path, options: Any, validator: Validator) -> None:
        if options.tp is not None or options.ranks is not None or options.shared_h:
            raise UsageError("--tp, --ranks and --shared-h do not apply with --to exl3-v1 (it has no rank axis)")
        self.ck, self.out, self.opt, self.validator = ck, out, options, validator
        self.layers = parse_selection(options.layers, [li for li, moe in ck.layers.items() if moe.experts], "layers")

    def plan(self) -> OutputPlan:
        """The rates exl3-v1 can declare for these K (mixed K: whole 256-channel pairs per rank), the codebook and
        the carried files, refused here; sizes: each layer file as its source shard's data (the codes it holds,
        and fewer vectors), the carried files as they are."""
        ck, layers = self.ck, self.layers
        self.tiers = {li: layer_tiers(ck, li) for li in layers}
        self.m = target_manifest(ck, self.tiers)
        self.copies = carried_files(ck, self.opt.copy_other)
        refuse_collisions([(MANIFEST_FILE, "the exl3-v1 manifest"), ("config.json", "the carried config.json")]
                          + [(layer_file_name(li), f"the exl3-v1 file of layer {li}") for li in layers]
                          + [(name, f"source file {name}") for name in self.copies], [])
        layer_bytes = _output_bytes(ck, layers)
        files: list[dict[str, Any]] = [{"name": layer_file_name(li), "bytes_planned": _output_bytes(ck, [li])}
                                       for li in layers]
        files += [{"name": n, "bytes": max(ck.files.get(n, 0), 0)} for n in self.copies]
        files += [{"name": "config.json"}, {"name": MANIFEST_FILE}]
        copied = sum(max(ck.files.get(n, 0), 0) for n in self.copies)
        return OutputPlan(conversion=f"{ck.dialect} -> exl3-v1", out=self.out, protected=protected_paths(ck),
                          fingerprint=_fingerprint(ck, layers), files=files, bytes_needed=layer_bytes + copied,
                          progress_total=layer_bytes, selection={"layers": layers},
                          notes=[NOT_VALIDATED, "layer files planned at their source shards' size (exl3-v1 holds "
                                 "the same codes and fewer vectors)"])

    def data_checks(self) -> None:
        check_hidden_side_equal(self.ck, self.layers)

    def write(self, stage: StagedOutput, result: RepackResult, on_bytes: Progress) -> None:
        ck, m = self.ck, self.m
        hashes = SourceHashes(ck)
        for li in self.layers:
            name, sources = layer_file_name(li), hashes.of(ck.layers[li].files)
            if not stage.completed(name, sources):
                path = stage.file(name, f"the exl3-v1 file of layer {li}")
                write_converted_layer(ck, m, li, self.tiers[li], path, on_bytes)
                stage.record(name, file_entry(path), sources)
                result.files_written += 1
                result.bytes_written += path.stat().st_size
            else:
                result.files_resumed += 1
            m.layers[li] = LayerEntry(name, stage.done[name]["sha256"])
        note = {"source_dialect": ck.dialect, "tp": ck.tp, "vector_ndim": vector_ndim(ck),
                "shard_names": {str(li): sorted(ck.layers[li].files)[0] for li in self.layers}}
        write_carried(ck, stage.path, self.copies, NOTE_KEY, note)
        for name in self.copies:
            hashes.check_copy(name, stage.path / name)
        write_manifest(stage.path, m, MANIFEST_FILE)

    def verify(self, tree: Path) -> None:
        _final_check(tree, self.validator)


def _fingerprint(ck: Checkpoint, layers: list[int]) -> dict[str, Any]:
    return {"source": ck.source.describe(), "to": "exl3-v1", "layers": layers}


def _output_bytes(ck: Checkpoint, layers: list[int]) -> int:
    return sum(ck.headers[f].data_end for li in layers for f in ck.layers[li].files if f in ck.headers)


def _final_check(root: Path, validator: Validator) -> None:
    from trellis_cli.dialects import open_checkpoint

    report = validator(open_checkpoint(root))
    if not report.ok:
        raise CheckFailed(f"{root}: the staged exl3-v1 output does not validate: {report.errors[0].line()}")


__all__ = ["Tr3ToExl3v1"]
