"""What a repack conversion's driver is, and what it is handed: the contract between a driver (in its dialect's
package, listed by the dialect's `drivers`) and repack's one staged run (repack/staged_run.py), which owns
everything around it: OUT's checks, the lock, the stage and its resume, the free space and the move into place.

A `Driver` plans (`plan()`: every file and byte, the refusals known before work; `--dry-run` is this plan), writes
into the staged tree it is handed (`write`, each file read back against its source) and checks the finished tree
(`verify`). It fills the `RepackResult` the run returns. `Validator` is the source check repack is handed
(validate.run_validation where the CLI and the library call it), so neither repack nor a driver imports validate.

Output names are built by trellis, but some parts come from the checkpoint (a source file's name, the TR3 shard a
note in config.json names). `output_name` is the one check all of them pass before any work and again where the
file is opened for writing: relative, `/`-separated, every part a plain name (not empty, not `.` or `..`), no
backslash, drive letter, NUL or other control character. Anything else is refused by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, TypedDict

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.findings import Report
from trellis_cli.header import plain_relative, text_escape

NOT_VALIDATED = "the source was not validated (dry run): a real run validates it first"


@dataclass
class OutputPlan:
    """What a conversion would write, known before any work."""

    conversion: str  # "tr3/per_expert_v1 -> route-pack"
    out: Path
    protected: list[Path]  # what OUT may not overlap: the source and the files it is made of
    fingerprint: dict[str, Any]  # what a stage must have been made with to be resumed
    files: list[dict[str, Any]]  # {"name", and "bytes" (exact) or "data_bytes" (tensor data; a header follows)}
    bytes_needed: int  # every byte the output holds, as the free-space check counts it
    progress_total: int  # what the progress bar counts (the bytes the driver reports through on_bytes)
    selection: dict[str, Any] = field(default_factory=dict)  # layers, ranks, tp of the output, where it has them
    notes: list[str] = field(default_factory=list)


Progress = Callable[[int], None]
Validator = Callable[[Checkpoint], Report]  # a checkpoint -> the findings that decide whether it may be used


class _DryRunSelection(TypedDict, total=False):
    # what of the source the output holds, where the conversion selects it (OutputPlan.selection)
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


class Driver(ABC):
    """One conversion of the registry's table (`repack --to TARGET` from one source dialect)."""

    _planned: OutputPlan | None = None
    # True where a local source's dry run (and a real run's early refusals) can be planned from its declarations,
    # file sizes and the names in its raw headers, before the opening (`quick_plan`), to the same plan
    # as `plan()` makes from the opened checkpoint.
    plans_from_declarations: ClassVar[bool] = False

    @abstractmethod
    def plan(self) -> OutputPlan:
        """What would be written; raises what the real run would refuse before writing (reads headers and
        declarations, never tensor data)."""

    @classmethod
    def quick_plan(cls, ck: Checkpoint, out: Path, options: Any) -> OutputPlan | None:
        """Where `plans_from_declarations`: the plan of a local source opened from its declarations alone
        (`open_declared`: no header parsed), the same as `plan()` would make; None where it cannot tell without
        the full opening."""
        return None

    def planned(self) -> OutputPlan:
        """`plan()`, made once: the dry run's plan is the one the real run writes by."""
        if self._planned is None:
            self._planned = self.plan()
        return self._planned

    def data_checks(self) -> None:
        """Refusals that read tensor data (e.g. ranks whose vectors must be equal); run by the real run after the
        source validation, and by the dry run."""

    @abstractmethod
    def write(self, stage: StagedOutput, result: RepackResult, on_bytes: Progress) -> None:
        """Write every planned file into `stage` (resuming what it holds), each read back against its source."""

    @abstractmethod
    def verify(self, tree: Path) -> None:
        """Check the finished staged tree as a whole (CheckFailed when it does not hold); nothing reaches OUT."""


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


def output_name(name: Any, what: str) -> str:
    """`name` when it is a plain relative name under OUT; else a named refusal (`path.escape`, exit 1)."""
    if isinstance(name, str) and plain_relative(name):
        return name
    shown = text_escape(name) if isinstance(name, str) else f"{name!r} (a JSON {type(name).__name__})"
    raise CheckFailed(f"[path.escape] {what}: output name {shown} is not a plain file name under OUT (absolute, "
                      f"a `..` or empty part, a backslash or a control character); refusing before writing",
                      code="path.escape")


def output_path(tree: Path, name: Any, what: str = "output file") -> Path:
    """tree/name for a checked name (the same check as before the run, made again where the file is written)."""
    return tree / output_name(name, what)


def refuse_collisions(claims: list[tuple[str, str]], temporary: list[str]) -> None:
    """Refuse, before any work, two things that would be written under one name in OUT.

    `claims`: (output name, what writes it), e.g. ("manifest.json", "the route pack's manifest") or
    ("manifest.json", "source file manifest.json"). `temporary`: outputs written under `NAME.partial` first,
    a name no other output may take either.
    """
    for name, who in claims:
        output_name(name, who)
    seen: dict[str, str] = {}
    for name, who in [*claims, *((f"{t}.partial", f"the temporary name of {t}") for t in temporary)]:
        if name in seen:
            raise UsageError(f"{seen[name]} and {who} would both be written as OUT/{name}; refusing before any "
                             f"work (rename or remove the source file)")
        seen[name] = who
    for name, who in seen.items():  # a file where another output needs a folder ("extra" and "extra/x")
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in seen:
                raise UsageError(f"{seen[folder]} is written as OUT/{folder}, where {who} needs a folder; "
                                 f"refusing before any work (rename or remove the source file)")
