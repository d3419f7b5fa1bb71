"""`trellis repack BTX OUT --to exl3-v1` and `repack EXL3 OUT --to btx`: the same container under its other
names (dialects/btx/names.py), lossless by construction: every tensor's bytes are copied, never decoded.

A driver of the staged run (staged_run.py: lock, target check, free space, resume, the move into place); the
BTX dialect's writer (dialects/btx/write.py) renames each layer file and the manifest and reads every tensor
back against the source; the finished tree is validated under the target's own rules before it is moved.
Other files (config.json included) are copied byte for byte unless `--experts-only`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.btx.write import renamers, renamed_manifest, write_manifest, write_renamed_layer
from trellis_cli.dialects.exl3v1.container import container
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.conversion import RepackResult, Validator
from trellis_cli.dialects.source_facts import SourceHashes, protected_paths
from trellis_cli.dialects.conversion import NOT_VALIDATED, Driver, OutputPlan, Progress
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.dialects.conversion import refuse_collisions
from trellis_cli.selection import parse_selection

def btx_to_exl3v1(ck: Checkpoint, out: Path, options: Any, validator: Validator) -> Driver:
    return Rename(ck, out, options, validator, to_btx=False)


def exl3v1_to_btx(ck: Checkpoint, out: Path, options: Any, validator: Validator) -> Driver:
    return Rename(ck, out, options, validator, to_btx=True)


class Rename(Driver):
    """BTX -> exl3-v1 (`to_btx` False) or exl3-v1 -> BTX (True): each layer file renamed, bytes copied."""

    def __init__(self, ck: Checkpoint, out: Path, options: Any, validator: Validator, *, to_btx: bool) -> None:
        self.target = "btx" if to_btx else "exl3-v1"
        if options.tp is not None or options.ranks is not None or options.shared_h:
            raise UsageError(f"--tp, --ranks and --shared-h do not apply with --to {self.target} (a renaming: the "
                             "container has no rank axis)")
        self.ck, self.out, self.opt, self.validator, self.to_btx = ck, out, options, validator, to_btx

    def plan(self) -> OutputPlan:
        ck, target = self.ck, self.target
        self.box = box = container(ck)
        if box.manifest is None:
            raise CheckFailed(f"{box.manifest_file}: the manifest cannot be read (trellis validate says why)")
        layers = parse_selection(self.opt.layers, list(box.layers), "layers")
        _, _, _, file_name = renamers(self.to_btx)
        self.outputs = {li: file_name(box.layers[li].file) for li in layers}
        self.copies = _carried(ck, self.opt.copy_other)
        manifest_name = "btx-manifest.json" if self.to_btx else "exl3-manifest.json"
        refuse_collisions([(manifest_name, f"the {target} manifest")]
                          + [(name, f"the {target} file of layer {li}") for li, name in self.outputs.items()]
                          + [(name, f"source file {name}") for name in self.copies], [])
        # A renamed layer file: its source file's size, give or take the header's longer or shorter names.
        files: list[dict[str, Any]] = [{"name": name, "bytes_planned": ck.files.get(box.layers[li].file, 0)}
                                       for li, name in self.outputs.items()]
        files += [{"name": n, "bytes": ck.files.get(n, 0)} for n in self.copies] + [{"name": manifest_name}]
        total = sum(f.get("bytes", f.get("bytes_planned", 0)) for f in files)
        return OutputPlan(conversion=f"{ck.dialect} -> {target}", out=self.out, protected=protected_paths(ck),
                          fingerprint={"source": ck.source.describe(), "to": target, "layers": layers},
                          files=files, bytes_needed=total, progress_total=total, selection={"layers": layers},
                          notes=[NOT_VALIDATED])

    def write(self, stage: StagedOutput, result: RepackResult, on_bytes: Progress) -> None:
        ck, box = self.ck, self.box
        hashes = SourceHashes(ck)
        done: dict[int, tuple[str, str]] = {}
        for li, name in self.outputs.items():
            sources = hashes.of({box.layers[li].file})
            if not stage.completed(name, sources):
                path = stage.file(name, f"the {self.target} file of layer {li}")
                sha = write_renamed_layer(ck.source.local_path(box.layers[li].file), path, self.to_btx, on_bytes)
                stage.record(name, {"size": path.stat().st_size, "sha256": sha}, sources)
                result.files_written += 1
                result.bytes_written += path.stat().st_size
            else:
                result.files_resumed += 1
            done[li] = (name, stage.done[name]["sha256"])
        for name, path in self.copies.items():
            shutil.copyfile(path, stage.file(name, f"source file {name}"))
            hashes.check_copy(name, stage.path / name)
        write_manifest(stage.path, renamed_manifest(ck.source.read_json(box.manifest_file), self.to_btx, done),
                       self.to_btx)

    def verify(self, tree: Path) -> None:
        _final_check(tree, self.validator, self.target)


def _carried(ck: Checkpoint, copy_other: bool) -> dict[str, Path]:
    """Every file besides the manifest and the layer files it names, copied byte for byte (config.json too)."""
    if not copy_other:
        return {}
    box = container(ck)
    skip = {box.manifest_file, *(layer.file for layer in box.layers.values())}
    return {n: ck.source.local_path(n) for n in ck.files if n not in skip and ck.files[n] >= 0}


def _final_check(root: Path, validator: Validator, target: str) -> None:
    from trellis_cli.dialects import open_checkpoint

    report = validator(open_checkpoint(root))
    if not report.ok:
        raise CheckFailed(f"{root}: the staged {target} output does not validate: {report.errors[0].line()}")
