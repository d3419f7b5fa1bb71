"""The one registry of dialects: detection in order, lookup by name, the conversion table.

Adding a dialect is one package under dialects/ (a `Dialect` subclass, interface.py, whose `detect` reads its
own metadata) and one line in DIALECTS. Order is detection order: the first dialect whose metadata claims the
checkpoint wins (those that decide from their listing alone, `opens_from_listing`, are asked before config.json
is read); anything else is an UnknownDialect naming what was found.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects import b12x_trellis, btx, exl3, exl3v1, glm53, r7, routepack, tr3
from trellis_cli.dialects.interface import Dialect, DialectInfo, Probe
from trellis_cli.errors import UnknownDialect

DIALECTS: tuple[Dialect, ...] = (
    routepack.DIALECT,  # manifest.json says so; needs no config.json
    exl3v1.DIALECT,  # its manifest's kind and schema
    btx.DIALECT,  # btx-manifest.json's kind and schema (exl3-v1 under b12x 1.3.0's names)
    tr3.PER_EXPERT,  # config.json hybrid_tr3_tail, rotation_layout per_expert_v1
    tr3.SHARED_H,  # ... shared_h_v1
    r7.DIALECT,  # r7_routed_experts in the quantization config
    glm53.DIALECT,  # scope glm53_routed_experts_only in the quantization config (before plain exl3)
    exl3.DIALECT,  # quant_method exl3
    b12x_trellis.DIALECT,  # quant_method b12x_trellis (a version-2 block)
)
_BY_NAME = {d.name: d for d in DIALECTS}


def detect_from_listing(files: dict[str, int], read_json: Callable[[str], Any]) -> DialectInfo | None:
    """The first dialect that decides from its listing alone (`opens_from_listing`) and claims the checkpoint,
    asked before config.json is read; None when none does."""
    probe = Probe(files, None, None, read_json)
    for dialect in DIALECTS:
        if dialect.opens_from_listing:
            info = dialect.detect(probe)
            if info is not None:
                return info
    return None


def detect(probe: Probe) -> DialectInfo:
    """The first dialect that claims the checkpoint; UnknownDialect naming what was found when none does."""
    for dialect in DIALECTS:
        info = dialect.detect(probe)
        if info is not None:
            return info
    raise _not_understood(probe)


def _not_understood(probe: Probe) -> UnknownDialect:
    """The refusal when no dialect claims the checkpoint, naming what was found."""
    if probe.config is None:
        return UnknownDialect(_nothing_found(probe.files, "no config.json"))
    methods = probe.quant_methods()
    found = f"quant_method {methods[0]!r}" if methods else "no quantization_config"
    return UnknownDialect(_nothing_found(probe.files, f"config.json has {found} and no hybrid_tr3_tail"))


def _nothing_found(files: dict[str, int], what: str) -> str:
    shown = ", ".join(list(files)[:6]) + (", ..." if len(files) > 6 else "")
    return (f"not a checkpoint dialect trellis understands: {what} "
            f"(found {len(files)} file(s): {shown or 'none'}); expected a TR3 hybrid_tr3_tail contract, "
            "an exl3 quantization_config, R7 metadata, an exl3-v1 manifest or a route-pack manifest.json")


def dialect_named(name: str) -> Dialect:
    return _BY_NAME[name]


def dialect_of(ckpt: Checkpoint) -> Dialect:
    return _BY_NAME[ckpt.dialect]


def scope_of(ckpt: Checkpoint) -> tuple[Dialect, str] | None:
    """The dialect whose loader scope `ckpt` declares (`Dialect.scope_declared`) and the file declaring it; None
    when it declares none."""
    for dialect in DIALECTS:
        where = dialect.scope_declared(ckpt)
        if where is not None:
            return dialect, where
    return None


def layer_pack_store(directory: Path) -> Dialect | None:
    """The dialect whose checkpoint local `directory` is, when that dialect stores each (layer, rank) as a
    LayerPack file read as stored (`Dialect.holds_layer_packs`: a route pack); None otherwise."""
    return next((d for d in DIALECTS if d.holds_layer_packs(directory)), None)


def synth_module(target: str) -> Any:
    """The module that writes synthetic checkpoints of the dialect `repack --to` calls `target` (its `synth`)."""
    import importlib

    dialect = next(d for d in DIALECTS if d.target == target and d.synth)
    return importlib.import_module(dialect.synth or "")


def targets() -> list[str]:
    """What `repack --to` accepts: every dialect that is a conversion target."""
    return list(dict.fromkeys(d.target for d in DIALECTS if d.target))


@dataclass(frozen=True)
class Conversion:
    """One row of the conversion table: `repack --to target` from a `source` checkpoint, run by repack's
    `driver` (staging, lock, resume) with the target dialect's `writer` module laying out the output."""

    source: str
    target: str
    driver: str
    writer: str
    factory: str  # "module:factory" of the driver (`Dialect.drivers`): in the target's package or the source's


def conversions() -> list[Conversion]:
    """The table keyed by (from, to), as the target dialects declare it."""
    return [Conversion(source, d.target, driver, d.writer or "", d.drivers.get(driver, "")) for d in DIALECTS
            if d.target for source, driver in d.converts_from.items()]


def conversion(source: str, target: str) -> str | None:
    """The repack driver that writes dialect `target` from a checkpoint of dialect `source` (the table keyed by
    (from, to) that the target dialects declare); None when there is none."""
    for dialect in DIALECTS:
        if dialect.target == target and source in dialect.converts_from:
            return dialect.converts_from[source]
    return None


def sources_of(target: str) -> list[str]:
    """The dialects `target` can be written from, for a refusal that says what would work."""
    return sorted({s for d in DIALECTS if d.target == target for s in d.converts_from})
