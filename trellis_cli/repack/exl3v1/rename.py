"""`trellis repack BTX OUT --to exl3-v1` and `repack EXL3 OUT --to btx`: the same container under its other
names (dialects/btx/names.py), lossless by construction: every tensor's bytes are copied, never decoded.

The staged run (lock, target check, free space, resume, the move into place) as tr3_to_exl3v1 runs it; the
BTX dialect's writer (dialects/btx/write.py) renames each layer file and the manifest and reads every tensor
back against the source; the finished tree is validated under the target's own rules before it is moved.
Other files (config.json included) are copied byte for byte unless `--experts-only`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.btx.write import renamers, renamed_manifest, write_manifest, write_renamed_layer
from trellis_cli.dialects.exl3v1.container import container
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.repack.lock import StageLock
from trellis_cli.repack.result import RepackResult, Validator, check_source
from trellis_cli.repack.source_facts import SourceHashes, protected_paths
from trellis_cli.repack.staging import (Stage, announce, check_free_space, check_target, refuse_collisions,
                                        refuse_overlap, stage_path)
from trellis_cli.routepack.plan import parse_selection

DRIVERS = {"btx-to-exl3-v1": False, "exl3-v1-to-btx": True}  # driver -> writes BTX


def rename_repack(driver: str, ck: Checkpoint, out: Path, options, validator: Validator, *, on_bytes=None,
                  on_total=None, log=None) -> RepackResult:
    to_btx = DRIVERS[driver]
    target = "btx" if to_btx else "exl3-v1"
    if options.tp is not None or options.ranks is not None or options.shared_h:
        raise UsageError(f"--tp, --ranks and --shared-h do not apply with --to {target} (a renaming: the "
                         "container has no rank axis)")
    start = time.perf_counter()
    box = container(ck)
    if box.manifest is None:
        raise CheckFailed(f"{box.manifest_file}: the manifest cannot be read (trellis validate says why)")
    layers = parse_selection(options.layers, list(box.layers), "layers")
    _, _, _, file_name = renamers(to_btx)
    outputs = {li: file_name(box.layers[li].file) for li in layers}
    copies = _carried(ck, options.copy_other)
    manifest_name = "btx-manifest.json" if to_btx else "exl3-manifest.json"
    refuse_collisions([(manifest_name, f"the {target} manifest")]
                      + [(name, f"the {target} file of layer {li}") for li, name in outputs.items()]
                      + [(name, f"source file {name}") for name in copies], [])
    if options.validate:
        check_source(ck, validator)
    hashes = SourceHashes(ck)
    result = RepackResult(out)
    refuse_overlap(out, protected_paths(ck))
    fingerprint = {"source": ck.source.describe(), "to": target, "layers": layers}
    total = sum(ck.files.get(box.layers[li].file, 0) for li in layers) + sum(ck.files.get(n, 0) for n in copies)
    with StageLock(stage_path(out), out):
        check_target(out, protected_paths(ck), options.overwrite)
        stage = Stage(out, fingerprint, options.overwrite)
        announce(stage, log or (lambda _m: None))
        try:
            check_free_space(out, total - stage.bytes_done())
        except CheckFailed:
            stage.discard_if_new()
            raise
        (on_total or (lambda _n: None))(total)
        done: dict[int, tuple[str, str]] = {}
        with stage.discard_on_refusal():
            for li in layers:
                name, sources = outputs[li], hashes.of({box.layers[li].file})
                if not stage.completed(name, sources):
                    path = stage.file(name, f"the {target} file of layer {li}")
                    sha = write_renamed_layer(ck.source.local_path(box.layers[li].file), path, to_btx,
                                              on_bytes or (lambda _n: None))
                    stage.record(name, {"size": path.stat().st_size, "sha256": sha}, sources)
                    result.files_written += 1
                    result.bytes_written += path.stat().st_size
                else:
                    result.files_resumed += 1
                done[li] = (name, stage.done[name]["sha256"])
            for name, path in copies.items():
                shutil.copyfile(path, stage.file(name, f"source file {name}"))
                hashes.check_copy(name, stage.path / name)
            write_manifest(stage.path, renamed_manifest(ck.source.read_json(box.manifest_file), to_btx, done),
                           to_btx)
            _final_check(stage.path, validator, target)
        stage.move_into_place()
    result.seconds = time.perf_counter() - start
    return result


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
