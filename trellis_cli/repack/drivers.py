"""Which driver runs a conversion. The dialect registry's conversion table (`registry.conversions()`, declared
by each target dialect) is the one list of conversions: a row names its source, its target and its driver, and
`DRIVERS` below gives each driver its class here, once (a test holds the two equal). `run_repack` asks for the
row of (source dialect, `--to`) and gets a `staged_run.Driver` back: nothing else compares driver names.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects import registry
from trellis_cli.errors import UsageError
from trellis_cli.repack.convert import route_pack_to_tr3, tr3_to_tr3
from trellis_cli.repack.tr3_to_exl3v1 import Tr3ToExl3v1
from trellis_cli.repack.exl3v1_btx import Rename
from trellis_cli.repack.exl3v1_to_route_pack import Exl3v1ToRoutePack
from trellis_cli.repack.exl3v1_to_tr3 import exl3v1_to_tr3
from trellis_cli.repack.glm53_stream import Tr3ToStream, stream_to_tr3
from trellis_cli.repack.result import Validator
from trellis_cli.repack.staged_run import Driver
from trellis_cli.repack.tr3_to_route_pack import Tr3ToRoutePack

# (source, OUT, options, validator) -> the driver; the source is an opened Checkpoint, or a route pack's directory
DriverFactory = Callable[[Any, Path, Any, Validator], Driver]


def _route_pack_to_tr3(root: Any, out: Path, options: Any, validator: Validator) -> Driver:
    if not isinstance(root, Path):
        raise UsageError("a route pack converts back to TR3 from a local directory only")
    return route_pack_to_tr3(root, out, options, validator)


DRIVERS: dict[str, DriverFactory] = {
    "tr3-to-route-pack": Tr3ToRoutePack,
    "tr3-to-tr3": tr3_to_tr3,
    "route-pack-to-tr3": _route_pack_to_tr3,
    "tr3-to-exl3-v1": Tr3ToExl3v1,
    "exl3-v1-to-tr3": exl3v1_to_tr3,
    "exl3-v1-to-route-pack": Exl3v1ToRoutePack,
    "btx-to-exl3-v1": partial(Rename, to_btx=False),
    "exl3-v1-to-btx": partial(Rename, to_btx=True),
    "glm53-stream-to-tr3": stream_to_tr3,
    "tr3-to-glm53-stream": Tr3ToStream,
}


def conversion_of(source_dialect: str, target: str) -> registry.Conversion | None:
    """The registry's row for `repack --to target` from a checkpoint of `source_dialect`; None when there is none."""
    return next((row for row in registry.conversions() if row.source == source_dialect and row.target == target),
                None)


def no_conversion(source: str, target: str) -> str:
    reachable = [t for t in registry.targets() if conversion_of(source, t) is not None]
    instead = f"; from {source}: --to {' or --to '.join(reachable)}" if reachable else ""
    return (f"--to {target} reads {', '.join(registry.sources_of(target))} checkpoints; the source is "
            f"{source}{instead}")


def plans_from_declarations(source_dialect: str, target: str) -> bool:
    """Whether the driver of the row (source dialect, target) plans a local source from its declarations before
    the opening (`Driver.plans_from_declarations`: preflight.quick_dry_run); False when there is no such row."""
    row = conversion_of(source_dialect, target)
    factory = DRIVERS[row.driver] if row is not None else None
    return isinstance(factory, type) and issubclass(factory, Driver) and factory.plans_from_declarations


def driver_for(source_dialect: str, source: Checkpoint | Path, out: Path, options: Any, validator: Validator) -> Driver:
    """The driver of the registry's row (source dialect, options.to), built for this source and OUT; a usage
    error naming the targets this source has when the table has no such row."""
    row = conversion_of(source_dialect, options.to)
    if row is None:
        raise UsageError(no_conversion(source_dialect, options.to))
    return DRIVERS[row.driver](source, out, options, validator)


__all__ = ["DRIVERS", "conversion_of", "driver_for", "plans_from_declarations"]
