"""`run_repack`: any conversion of the dialect registry's table, as a driver (drivers.py) on the one staged run
(staged_run.py), or its dry run.

Order of work: a local source whose driver plans from its declarations (`Driver.quick_plan`: TR3 headed for a
route pack) is first planned from them and its raw headers (`quick_dry_run`: the dry run's answer, and a real run's
refusals before the slow opening); otherwise the source is opened (a directory of LayerPack files, a route pack, is
read by its driver), the registry's row for (its dialect, `--to`) gives the driver, and `--dry-run` is that driver's plan with the staged run's checks of OUT and free space. A real run is
`staged_run.run_staged`: plan, OUT and free space, the source's validation, the lock, write, verify, move.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import byte_faults
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.conversion import Driver, RepackResult, Validator
from trellis_cli.errors import ValidationFailed
from trellis_cli.findings import Severity
from trellis_cli.repack.staged_run import check_before_work, dry_run, run_staged
from trellis_cli.sources import SourceArg


@dataclass
class RepackOptions:
    layers: list[int] | None = None  # [3, 4, 5, 40] (a "3-5,40" text is parsed once, here)
    ranks: list[int] | None = None  # [0, 1] (of the target TP)
    tp: int | None = None  # target TP; None keeps the source's
    shared_h: bool = False  # collapse hidden-side rows to [1, H] (refused unless byte-equal)
    to: str = "route-pack"  # a conversion target of the dialect registry: route-pack, tr3, exl3-v1, btx, glm53-stream
    jobs: int = 1
    overwrite: bool = False
    copy_other: bool = True  # carry non-expert files and tensors through
    validate: bool = True
    dry_run: bool = False  # plan and check (OUT, names, free space), write nothing, skip the source validation

    def __post_init__(self) -> None:
        """Typed once: a `--layers` / `--ranks` text becomes the id list every driver reads."""
        from trellis_cli.selection import parse_layer_ranges

        for name in ("layers", "ranks"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, parse_layer_ranges(value, option=f"--{name}") if value.strip() else None)


def open_repack_source(source: SourceArg, progress: Callable[[str, int, int], None] | None = None) -> Checkpoint:
    from trellis_cli.dialects.open import open_checkpoint

    return open_checkpoint(source, progress=progress)


def run_repack(source: SourceArg | Checkpoint, out: str | Path, options: RepackOptions | None = None, *, validator: Validator,
               on_bytes: Callable[[int], None] | None = None, on_total: Callable[[int], None] | None = None,
               log: Callable[[str], None] | None = None,
               on_stage: Callable[[str, int, int], None] | None = None) -> RepackResult:
    """Repack `source` (a Source, a path, or an opened Checkpoint) into `out`; see the module docstring.

    `validator` decides whether the source may be repacked (with `options.validate`) and whether a staged
    conversion output is sound: `trellis_cli.run_repack` passes validate.run_validation. `on_stage(stage, done,
    total)` follows the opening of the source (headers, model)."""
    options = options or RepackOptions()
    out = Path(out)
    from trellis_cli.dialects import registry
    from trellis_cli.repack.drivers import conversion_of, driver_for

    if options.to not in registry.targets():
        raise UsageError(unknown_target(options.to))
    if options.jobs < 1:
        raise UsageError(f"--jobs {options.jobs}: must be at least 1")

    root = _local_root(source)
    # A directory of LayerPack files (a route pack) is converted from its directory by its driver, not opened.
    store = registry.layer_pack_store(root) if root is not None else None
    if root is not None and not isinstance(source, Checkpoint) and store is None:
        # Planned from declarations, file sizes and names in the raw headers, seconds before the opening: the
        # dry run's answer, and a real run's refusal (no space, OUT, a name claimed twice) before the slow part.
        quick = quick_dry_run(source, out, options)
        if quick is not None and options.dry_run:
            return quick
        if quick is not None and quick.plan and quick.plan["refusals"]:
            raise CheckFailed(quick.plan["refusals"][0])
    checkpoint: Checkpoint | None = None
    if root is not None and store is not None:
        if conversion_of(store.name, options.to) is None:
            raise UsageError(f"{root} is already a route pack; pass --to tr3 to convert it back to TR3")
        packs = store.name
        make: Callable[[], Driver] = lambda: driver_for(packs, root, out, options, validator)
    else:
        checkpoint = source if isinstance(source, Checkpoint) else open_repack_source(source, on_stage)
        opened = checkpoint
        make = lambda: driver_for(opened.dialect, opened, out, options, validator)
    if options.dry_run:
        return dry_run(make(), options.overwrite)
    validate = None
    if checkpoint is not None and options.validate:
        validate = lambda: check_source(checkpoint, validator)
    driver = _planned(make, checkpoint, validate)
    return run_staged(driver, options.overwrite, check_source=validate, on_bytes=on_bytes, on_total=on_total,
                      log=log)


def check_source(checkpoint: Checkpoint, validator: Validator) -> None:
    """Refuse an invalid source before writing anything."""
    report = validator(checkpoint)
    if not report.ok:
        raise ValidationFailed(report, list_errors=True)


def quick_dry_run(source: SourceArg, out: Path, options: RepackOptions) -> RepackResult | None:
    """The dry run of a local source opened from its declarations alone (`open_declared`: no header parsed),
    where the driver of (its dialect, `options.to`) plans from them (`Driver.quick_plan`), answered like any
    plan (OUT, the lock file, free space); None where that is not possible (another dialect, a Hub source, a
    declaration it cannot plan from): the caller then opens the checkpoint in full."""
    from trellis_cli.dialects.open import open_declared
    from trellis_cli.repack.drivers import quick_planner

    if isinstance(source, (str, Path)):
        from trellis_cli.sources import LocalSource

        source = LocalSource(Path(source))
    if source.root is None or source.special:
        return None
    ck = open_declared(source)
    if ck is None or any(f.severity is Severity.ERROR for f in ck.parse_findings):
        return None
    # no such conversion (the full path names those this source has), or one whose dry run is its driver's plan
    # from the full opening
    planner = quick_planner(ck.dialect, options.to)
    plan = planner.quick_plan(ck, out, options) if planner is not None else None
    if plan is None:
        return None
    result = RepackResult(out)
    result.plan = check_before_work(plan, options.overwrite)
    return result


def unknown_target(to: str) -> str:
    """The refusal of a `--to` the registry has no target for; a target spelled another way (`routepack`,
    `route_pack`, `EXL3V1`) is named as the word to use."""
    from trellis_cli.dialects import registry

    def bare(word: str) -> str:
        return "".join(c for c in word.lower() if c.isalnum())

    meant = next((t for t in registry.targets() if bare(t) == bare(to)), None)
    hint = f" (did you mean --to {meant}?)" if meant else ""
    return f"--to {to!r}: expected {', '.join(registry.targets())}{hint}"


def _planned(make: Callable[[], Driver], checkpoint: Checkpoint | None,
             validate: Callable[[], None] | None) -> Driver:
    """The driver, planned. A plan that fails on a source that does not validate gets the validation's answer
    (it names the file, tensor and rule); a usage error of a readable source (an option, OUT) is said at once."""
    try:
        driver = make()
        driver.planned()
        return driver
    except UsageError:
        if validate is None or checkpoint is None or not any(byte_faults(checkpoint)):
            raise
        validate()
        raise
    except Exception:
        if validate is None:
            raise
        validate()
        raise


def _local_root(source: SourceArg | Checkpoint) -> Path | None:
    if isinstance(source, (str, Path)):
        return Path(source) if Path(source).is_dir() else None
    if isinstance(source, Checkpoint):
        source = source.source
    return source.root


__all__ = ["RepackOptions", "run_repack"]
