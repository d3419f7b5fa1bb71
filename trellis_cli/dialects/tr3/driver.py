"""The driver that writes a `--to tr3` output, whatever it is made from (a route pack, TR3 re-sliced, exl3-v1):
what the output holds is the TR3 dialect's writer (dialects/tr3/write.py, `Tr3Output`), handed the staged tree
(`Stage`) by the staged run (staged_run.py), which owns OUT.partial, its lock, resume, free space and the move."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trellis_cli.dialects.tr3.write import CONFIG, DEFAULT_METADATA, INDEX_NAME, Tr3Output
from trellis_cli.integrity import CHECKSUM_MANIFEST
from trellis_cli.dialects.conversion import RepackResult
from trellis_cli.dialects.conversion import NOT_VALIDATED, Driver, OutputPlan, Progress
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.dialects.conversion import refuse_collisions
from trellis_cli.dialects import carry
from trellis_cli.dialects.routepack import manifest as mf
from trellis_cli.checkpoint.tensor_bytes import TensorReader


class Tr3Driver(Driver):
    """Staged, resumable writing of TR3 shards plus the JSON and copied files around them."""

    def __init__(self, conversion: str, out: Path, output: Tr3Output, notes: tuple[str, ...] = (NOT_VALIDATED,)) -> None:
        self.conversion, self.out, self.output, self.notes = conversion, out, output, list(notes)

    def plan(self) -> OutputPlan:
        output = self.output
        output.refuse_unrepresentable()
        output.narrow_declarations()
        refuse_collisions(output.claims(), output.all_shards())
        # Every byte of the output (Tr3Output.bytes_to_write, file by file): shards with their headers, copied
        # and rewritten files; config.json, the index and MANIFEST.sha256 are small and written last.
        files: list[dict[str, Any]] = [
            {"name": s, "bytes": carry.file_bytes(output.shard_tensors(s), output.metadata.get(s, DEFAULT_METADATA))}
            for s in output.all_shards()]
        files += [{"name": n, "bytes": path.stat().st_size} for n, path in output.copied.items()]
        files += [{"name": n, "bytes": len(text.encode())} for n, text in output.rewritten.items()]
        needed = sum(f["bytes"] for f in files)
        files += [{"name": CONFIG}, {"name": INDEX_NAME}, {"name": CHECKSUM_MANIFEST}]
        root = output.source_root
        protected = [] if root is None else [root] if isinstance(root, Path) else list(root)
        tps = sorted({spec.tp for spec in output.specs.values()})
        return OutputPlan(conversion=self.conversion, out=self.out, protected=protected,
                          fingerprint=output.fingerprint, files=files, bytes_needed=needed, progress_total=needed,
                          selection={"layers": sorted(output.specs), "tp": tps[0] if len(tps) == 1 else tps},
                          notes=self.notes)

    def write(self, stage: StagedOutput, result: RepackResult, on_bytes: Progress) -> None:
        output = self.output
        weight_map: dict[str, str] = {}
        with TensorReader(output.carried_source) as reader:
            for shard in output.all_shards():
                sources = output.sources(shard)
                if stage.completed(shard, sources):
                    result.files_resumed += 1
                    on_bytes(output.shard_path(stage, shard).stat().st_size)
                else:
                    path = output.write_shard(stage, shard, reader, on_bytes)
                    stage.record(shard, mf.file_entry(path), sources)
                    result.files_written += 1
                    result.bytes_written += path.stat().st_size
                weight_map.update(dict.fromkeys((t.name for t in output.shard_tensors(shard)), shard))
        output.write_rest(stage, weight_map)

    def verify(self, tree: Path) -> None:
        self.output.final_check(tree)


def fingerprint_options(options: Any) -> dict[str, Any]:
    return {k: getattr(options, k) for k in ("layers", "ranks", "tp", "shared_h", "to")}


__all__ = ["Tr3Driver", "fingerprint_options"]
