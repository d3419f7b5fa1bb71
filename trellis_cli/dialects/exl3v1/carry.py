"""Files carried through a conversion between TR3 and exl3-v1: everything that is not a routed expert.

config.json is carried with a note under its own key (what the way back needs: the source's TP, vector
shapes and shard names); other files are copied byte for byte. Expert shards are rebuilt, never copied; an
expert shard that also holds other tensors cannot be carried (exl3-v1 layer files hold experts only), so it
is refused unless `--experts-only` drops those tensors. Indexes and MANIFEST.sha256 describe the old files
and are not carried.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.errors import UsageError
from trellis_cli.dialects.conversion import output_path

CONFIG = "config.json"
NOT_CARRIED = ("MANIFEST.sha256",)


def carried_files(ck: Checkpoint, copy_other: bool, skip: frozenset[str] = frozenset()) -> dict[str, Path]:
    """Name -> local path of every file copied verbatim (nothing when `copy_other` is off)."""
    from trellis_cli.dialects.registry import dialect_of
    from trellis_cli.dialects.carry import non_expert_refs

    expert_files = {f for moe in ck.layers.values() for f in moe.files}
    if copy_other and dialect_of(ck).shard_rules:  # per-linear shards may mix; exl3-v1 layer files hold experts only
        mixed = sorted(f for f in non_expert_refs(ck) if f in expert_files)
        if mixed:
            raise UsageError(f"{mixed[0]}: holds routed experts and other tensors; exl3-v1 layer files hold experts "
                             "only (pass --experts-only to leave the other tensors out)")
    if not copy_other:
        return {}
    return {n: ck.source.local_path(n) for n in ck.files
            if n not in expert_files and n not in skip and n != CONFIG and n not in NOT_CARRIED
            and not n.endswith(".index.json") and ck.files[n] >= 0}


def write_carried(ck: Checkpoint, stage: Path, copies: dict[str, Path], note_key: str | None,
                  note: dict[str, Any] | None, config: dict[str, Any] | None = None) -> None:
    for name, path in copies.items():
        target = output_path(stage, name, f"source file {name}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    if config is None and CONFIG in ck.files:
        config = {k: v for k, v in ck.config.items() if k != note_key}
        if note_key is not None:
            config[note_key] = note
    if config is not None:
        (stage / CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
