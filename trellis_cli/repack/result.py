"""What every repack driver shares at its ends: the source check it is handed, the format check of a staged
conversion output, and the RepackResult it returns (the note a route pack leaves in config.json is the route
pack writer's, dialects/routepack/write.py).

The source check is a function passed in (`Validator`: validate.run_validation where the CLI and the library
API call a repack), so repack never imports validate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypedDict

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.errors import CheckFailed, ValidationFailed
from trellis_cli.findings import Report

Validator = Callable[[Checkpoint], Report]  # a checkpoint -> the findings that decide whether it may be used


class _DryRunSelection(TypedDict, total=False):
    # what of the source the output holds, where the conversion selects it (staged_run.OutputPlan.selection)
    layers: str  # id ranges
    ranks: list[int]
    tp: int | list[int]


class DryRunPlan(_DryRunSelection):
    """`repack --dry-run`: what a run would write, OUT's free space, and the refusals a real run would make. The
    wire shape of `repack --dry-run --json` (which adds `"dry_run": true` first): conversion, out, the
    selection, then the keys below, in that order."""

    conversion: str  # "tr3/per_expert_v1 -> route-pack"
    out: str
    files: list[dict[str, Any]]  # {"name", and "bytes" (exact) or "data_bytes" (tensor data; a header follows)}
    bytes_needed: int
    bytes_resumable: int  # of it, already verified in OUT.partial
    free_bytes: int
    space_ok: bool
    refusals: list[str]
    notes: list[str]


@dataclass
class RepackResult:
    out: Path
    files_written: int = 0
    files_resumed: int = 0
    bytes_written: int = 0
    bytes_needed: int = 0  # every byte the output holds, as the free-space check counted it
    seconds: float = 0.0
    manifest: dict[str, Any] = field(default_factory=dict)
    plan: DryRunPlan | None = None  # --dry-run: what a run would write, and its checks; nothing written

    def summary(self, to: str, seconds: float, notes: list[str]) -> RepackSummary:
        """What `trellis repack --json` prints of a finished run; `seconds`: the whole command's, opening included."""
        return RepackSummary(
            out=str(self.out), to=to, files_written=self.files_written, files_resumed=self.files_resumed,
            bytes_written=self.bytes_written, bytes_needed=self.bytes_needed, seconds=round(seconds, 3),
            write_seconds=round(self.seconds, 3),
            throughput_mb_s=round(self.bytes_written / self.seconds / 1e6, 1) if self.seconds else None, notes=notes)


@dataclass(frozen=True)
class RepackSummary:
    """A finished repack, in the key order of `trellis repack --json`."""

    out: str
    to: str  # the --to target
    files_written: int
    files_resumed: int  # verified files an interrupted run had staged
    bytes_written: int
    bytes_needed: int
    seconds: float  # the whole run: opening, validating, planning and writing
    write_seconds: float  # the staged write and its read-back
    throughput_mb_s: float | None  # bytes written per write second; None when nothing was timed
    notes: list[str]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_source(checkpoint: Checkpoint, validator: Validator) -> None:
    """Refuse an invalid source before writing anything."""
    report = validator(checkpoint)
    if not report.ok:
        raise ValidationFailed(report, list_errors=True)


# Loader refusals of the K layout itself (tier counts, K sets): a conversion carries the data's K faithfully, and
# which loader serves that layout is the user's choice. Every other refusal is of a declaration trellis wrote.
CARRIED_K_LAYOUT = frozenset({"engine.tier-count", "engine.k-values", "engine.unused-k", "engine.uniform-k",
                              "engine.k-per-projection"})
# The model weights besides the experts are carried as the source holds them (or lacks them): a conversion adds
# none and drops none, so an experts-only source gives an experts-only output, which validate then names.
CARRIED_MODEL_WEIGHTS = frozenset({"engine.weights-missing", "engine.weights-shape", "engine.weights-config"})


def check_output(tree: Path, validator: Validator, target: str) -> None:
    """Refuse a staged conversion output that its own validator refuses: a format error, or a refusal of the
    output dialect's default loader other than of the K layout the data carries. Nothing then reaches OUT."""
    from trellis_cli.dialects import open_checkpoint

    report = validator(open_checkpoint(tree))
    errors = [f.line() for f in report.errors if not f.code.startswith("engine.")]
    codes = [f.code for f in report.errors if not f.code.startswith("engine.")]
    for verdict in report.engines:
        if verdict["default"]:
            for reason in verdict["reasons"]:
                if reason["code"] not in CARRIED_K_LAYOUT | CARRIED_MODEL_WEIGHTS and reason["code"] != "format":
                    errors.append(f"[{reason['code']}] {verdict['name']}: {reason['message']}")
                    codes.append(reason["code"])
    if errors:
        raise CheckFailed(f"the {target} output would not validate: {errors[0]}; refusing (nothing written "
                          f"to OUT; the source holds what {target} cannot declare)", code=codes[0])


__all__ = ["RepackResult", "Validator", "check_output", "check_source"]
