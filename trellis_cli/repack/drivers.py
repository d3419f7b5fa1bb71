"""Which driver runs a conversion. The dialect registry's conversion table (`registry.conversions()`, declared
by each target dialect) is the one list of conversions: a row names its source, its target, its driver and the
driver's factory, which lives in the package of the row's target or source dialect (`Dialect.drivers`).
`run_repack` asks for the row of (source dialect, `--to`) and gets a `conversion.Driver` back: nothing here
knows a driver, a dialect or a driver's name.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects import registry
from trellis_cli.dialects.conversion import Driver, Validator
from trellis_cli.errors import UsageError

# (source, OUT, options, validator) -> the driver; the source is an opened Checkpoint, or the directory of a
# checkpoint stored as LayerPack files (a route pack), which its driver reads itself
DriverFactory = Callable[[Any, Path, Any, Validator], Driver]


def conversion_of(source_dialect: str, target: str) -> registry.Conversion | None:
    """The registry's row for `repack --to target` from a checkpoint of `source_dialect`; None when there is none."""
    return next((row for row in registry.conversions() if row.source == source_dialect and row.target == target),
                None)


def factory_of(row: registry.Conversion) -> DriverFactory:
    """The driver factory a row names ("module:factory"), imported on first use."""
    module, _, name = row.factory.partition(":")
    factory: DriverFactory = getattr(importlib.import_module(module), name)
    return factory


def no_conversion(source: str, target: str) -> str:
    reachable = [t for t in registry.targets() if conversion_of(source, t) is not None]
    instead = f"; from {source}: --to {' or --to '.join(reachable)}" if reachable else ""
    return (f"--to {target} reads {', '.join(registry.sources_of(target))} checkpoints; the source is "
            f"{source}{instead}")


def quick_planner(source_dialect: str, target: str) -> type[Driver] | None:
    """The driver class of the row (source dialect, target) when it plans a local source from its declarations
    before the opening (`Driver.plans_from_declarations`, `Driver.quick_plan`); None otherwise or without a row."""
    row = conversion_of(source_dialect, target)
    factory = factory_of(row) if row is not None else None
    if isinstance(factory, type) and issubclass(factory, Driver) and factory.plans_from_declarations:
        return factory
    return None


def driver_for(source_dialect: str, source: Checkpoint | Path, out: Path, options: Any, validator: Validator) -> Driver:
    """The driver of the registry's row (source dialect, options.to), built for this source and OUT; a usage
    error naming the targets this source has when the table has no such row."""
    row = conversion_of(source_dialect, options.to)
    if row is None:
        raise UsageError(no_conversion(source_dialect, options.to))
    return factory_of(row)(source, out, options, validator)


__all__ = ["conversion_of", "driver_for", "factory_of", "quick_planner"]
