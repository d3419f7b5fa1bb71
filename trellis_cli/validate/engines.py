"""Loader profiles: which serving engine will take a checkpoint, rule by rule.

A profile is a named, versioned rule set: plain data (name, label, the loader version it was read from) plus
the small checks of engine_rules.py that yield what that loader refuses. `trellis validate` enforces one
profile (`--engine NAME`, or the default for the checkpoint's dialect): its refusals become error findings
carrying the engine name. Every other profile is evaluated too and reported in the compatibility verdicts,
not enforced. docs/engines.md lists each rule with where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.registry import dialect_named
from trellis_cli.errors import UsageError
from trellis_cli.findings import Finding, Report, Severity
from trellis_cli.validate import engine_rules as r

Rule = Callable[[Checkpoint, list[int]], Iterator[r.Refusal]]
MAX_REASONS = 20  # per engine in the JSON verdict; then a count
CONTAINER = "engine.container"


@dataclass(frozen=True)
class Engine:
    name: str  # what --engine takes
    label: str  # how the compatibility line shows it
    version: int  # of this rule set: bumped when a rule changes
    reads: str  # the loader version the rules were read from (docs/engines.md has the detail)
    rules: tuple[Rule, ...]


_VLLM_COMMON = (r.vllm_container, r.tensor_storage, r.legacy_signs, r.tier_count)

ENGINES: tuple[Engine, ...] = (
    Engine("vllm-exl3-shared-h", "vllm-exl3 (shared-H rules)", 1,
           "local-inference-lab/vllm exl3.py with rotation_layout and _normalize_rank_sliced_metadata",
           _VLLM_COMMON + (r.bits_exact, r.k_values_two, r.every_k_used, r.bitmap_field, r.uniform_map)),
    Engine("vllm-exl3-190", "vllm-exl3 (#190 rules)", 1,
           "local-inference-lab/vllm exl3.py of the #190 era (rank-sliced, mixed K3/K4, no rotation_layout)",
           _VLLM_COMMON + (r.shared_h_unsupported, r.uniform_k_190)),
    Engine("b12x-exl3-v1", "b12x exl3-v1", 1, "b12x 1.5.x moe/checkpoints exl3-v1 reader", (r.b12x_container,)),
    Engine("exllamav3", "exllamav3", 1, "turboderp-org/exllamav3 loader (per-linear names, MultiLinear)",
           (r.exllamav3_container, r.one_k_per_projection)),
)
BY_NAME = {e.name: e for e in ENGINES}
DEFAULT = "default"  # run_validation(engine=DEFAULT): the dialect's default profile


def engine_named(name: str) -> Engine:
    engine = BY_NAME.get(name)
    if engine is None:
        raise UsageError(f"--engine {name!r}: unknown engine (known: {', '.join(BY_NAME)})")
    return engine


def default_engine(dialect: str) -> str | None:
    """The dialect's own choice (Dialect.default_engine): the newest rank-sliced loader for TR3, each other
    container's own reader; None for a dialect no profiled loader reads (R7, a route pack)."""
    return dialect_named(dialect).default_engine


def enforced_name(engine: str | None, dialect: str) -> str | None:
    """`DEFAULT` -> the dialect's default profile; None -> no profile enforced; else the named one."""
    if engine is None:
        return None
    return default_engine(dialect) if engine == DEFAULT else engine_named(engine).name


def refusals(engine: Engine, ckpt: Checkpoint, layers: list[int]) -> list[r.Refusal]:
    """What `engine` refuses; a container it does not read at all ends the list (nothing else is looked up)."""
    found: list[r.Refusal] = []
    for rule in engine.rules:
        found.extend(rule(ckpt, layers))
        if any(x.code == CONTAINER for x in found):
            return [x for x in found if x.code == CONTAINER]
    return found


def to_finding(engine: Engine, refusal: r.Refusal) -> Finding:
    return Finding(refusal.code, Severity.ERROR, refusal.where, refusal.message, refusal.expected, refusal.found,
                   engine=engine.name)


def assess(ckpt: Checkpoint, layers: list[int], report: Report, enforced: str | None) -> None:
    """Add the enforced engine's refusals to `report` as errors, then every engine's verdict to report.engines.

    Call after every other rule has run: a format error (no engine) is a refusal of every engine too.
    """
    per_engine = {e.name: refusals(e, ckpt, layers) for e in ENGINES}
    if enforced is not None:
        engine = BY_NAME[enforced]
        report.extend(to_finding(engine, refusal) for refusal in per_engine[enforced])
    format_errors = [f for f in report.errors if f.engine is None]
    report.engines = [_verdict(e, per_engine[e.name], format_errors, enforced, ckpt.dialect) for e in ENGINES]


def _verdict(engine: Engine, refused: list[r.Refusal], format_errors: list[Finding], enforced: str | None,
             dialect: str) -> dict:
    reasons = [{"code": x.code, "reason": x.reason, "message": x.message, "location": x.where.to_dict()}
               for x in refused]
    if format_errors:
        codes = sorted({f.code for f in format_errors})
        reasons.append({"code": "format", "reason": f"{len(format_errors)} format error(s): {', '.join(codes[:3])}",
                        "message": "errors of the format rules, which every loader refuses", "location": {}})
    verdict = {"name": engine.name, "label": engine.label, "version": engine.version, "reads": engine.reads,
               "enforced": engine.name == enforced, "default": engine.name == default_engine(dialect),
               "loads": not reasons, "reasons": reasons[:MAX_REASONS]}
    if len(reasons) > MAX_REASONS:
        verdict["more_reasons"] = len(reasons) - MAX_REASONS
    return verdict


def unreadable_verdicts(why: str) -> list[dict]:
    """Verdicts for a checkpoint that could not be opened: no engine loads it."""
    return [{"name": e.name, "label": e.label, "version": e.version, "reads": e.reads, "enforced": False,
             "default": False, "loads": False,
             "reasons": [{"code": "unreadable", "reason": why, "message": why, "location": {}}]} for e in ENGINES]


def compatibility_line(verdicts: list[dict], markers_read: bool = True) -> str:
    """`loads on: vllm-exl3 (shared-H rules) ✓ · vllm-exl3 (#190 rules) ✗ shared_h_v1 unsupported · ...`"""
    parts = []
    for v in verdicts:
        text = f"{v['label']} ✓" if v["loads"] else f"{v['label']} ✗ {v['reasons'][0]['reason']}"
        more = len(v["reasons"]) - 1 + v.get("more_reasons", 0)
        if more > 0:
            text += f" (+{more} more)"
        parts.append(text)
    head = "loads on" if markers_read else "loads on (codebook markers not read)"
    return f"{head}: " + " · ".join(parts)
