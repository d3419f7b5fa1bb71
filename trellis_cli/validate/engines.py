"""Loader profiles: which serving engine will take a checkpoint, rule by rule.

A profile is a named, versioned rule set: plain data (name, label, the loader version it was read from) plus
the small checks that yield what that loader refuses (engine_rules.py; engine_stamps.py for the quantization
config, stamps and JSON integers; engine_protected.py for protected tensors; engine_r7.py for the R7 loader version; engine_manifest.py
for the mainline exl3-manifest loader) and its TP contract (engine_tp.py). `trellis validate` enforces one
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
from trellis_cli.findings import EngineReason, EngineVerdict, Finding, Report, Severity, TpVerdict
from trellis_cli.id_ranges import compact_ranges
from trellis_cli.validate import engine_manifest as m
from trellis_cli.validate import engine_protected as pr
from trellis_cli.validate import engine_r7 as r7
from trellis_cli.validate import engine_rules as r
from trellis_cli.validate import engine_stamps as st
from trellis_cli.validate import engine_tp as tpc
from trellis_cli.validate import engine_weights as w

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
    tp_rule: tpc.TpRule | None = None  # why the loader refuses a server TP (engine_tp.py); None: no limit of its own
    # A profile read for one layout only: its verdict is listed where `scope` holds (or where it is enforced).
    scope: Callable[[Checkpoint], bool] | None = None

    def listed_for(self, ckpt: Checkpoint, enforced: str | None = None) -> bool:
        return self.scope is None or self.name == enforced or self.scope(ckpt)


_VLLM_COMMON = (r.vllm_container, st.embedded_quant_config, st.stamp_selects_exl3, r.module_records,
                r.legacy_signs, r.tier_count)

_R7_RULES = (r7.r7_container, st.embedded_quant_config, r7.r7_detected, r7.r7_contract, r7.glm53_contract,
             r7.glm53_stream, r7.glm53_external, st.stamp_selects_exl3, st.bits_required, pr.protected_r7, r7.r7_tensor_storage,
             r7.r7_layer_range, r7.r7_rank_free, r7.r7_shared_vectors, r7.r7_undeclared_k, r.legacy_signs,
             r.tier_count, r7.uniform_k_r7, w.model_weights_rule)

ENGINES: tuple[Engine, ...] = (
    Engine("vllm-exl3-shared-h", "vllm-exl3 (shared-H rules)", 4,
           "local-inference-lab/vllm exl3.py with rotation_layout and _normalize_rank_sliced_metadata",
           _VLLM_COMMON + (st.json_ints, st.bits_map, r.bits_map_k, r.bits_exact, r.k_values_two, r.every_k_used,
                           r.bitmap_field, r.uniform_map, pr.protected_storage, w.model_weights_rule), tpc.fork_tp),
    Engine("vllm-exl3-190", "vllm-exl3 (#190 rules)", 4,
           "yatesdr/vllm-opt@1f0baf95 exl3.py (#190: rank-sliced, int() coercion, no rotation_layout)",
           _VLLM_COMMON + (st.bits_required, pr.protected_190, r.shared_h_unsupported, r.uniform_k_190,
                           w.model_weights_rule),
           tpc.fork_tp),
    Engine("vllm-exl3-r7", "vllm-exl3 (R7 rules)", 4,
           "the fork's exl3.py with r7_routed_experts (r7-complete-v2-checkpoint-v1) and the GLM-5.3 scope",
           _R7_RULES, tpc.r7_fork_tp),
    Engine("vllm-exl3-manifest", "vllm-exl3 (manifest rules)", 2,
           "local-inference-lab/vllm@174fe4d exl3.py + utils/exl3.py over b12x 1.5.1's exl3-v1 reader",
           (m.manifest_container, m.manifest_config, m.manifest_geometry, m.uniform_rates, w.model_weights_mxfp8_rule),
           tpc.manifest_tp),
    Engine("b12x-exl3-v1", "b12x exl3-v1", 2, "b12x 1.5.x moe/checkpoints exl3-v1 reader",
           (r.b12x_container, w.model_weights_mxfp8_rule)),
    Engine("b12x-1.3.0", "b12x 1.3.0", 1, "b12x 1.3.0 wheel: kernels/w4a16/btx.py BTX reader, fused_moe/config.py "
           "TrellisConfig (sqg codebooks)", (r.b12x130_container, w.model_weights_mxfp8_rule)),
    Engine("exllamav3", "exllamav3", 2, "turboderp-org/exllamav3 loader (per-linear names, MultiLinear)",
           (r.exllamav3_container, r.one_k_per_projection, w.model_weights_rule)),
    Engine("vllm-exl3-pr766", "vllm-exl3 (PR #766 relaxed TP)", 1,
           "local-inference-lab/vllm PR #766 (open; its description of 2026-09-15, code not read): the R7 version's "
           "GLM-5.3 scope with the unsliced stream's TP check lifted", (r7.pr766_container,) + _R7_RULES[1:],
           tpc.pr766_tp, scope=r7.glm53_scope),
)
BY_NAME = {e.name: e for e in ENGINES}
DEFAULT = "default"  # run_validation(engine=DEFAULT): the dialect's default profile


def engine_named(name: str) -> Engine:
    engine = BY_NAME.get(name)
    if engine is None:
        raise UsageError(f"--engine {name!r}: unknown engine (known: {', '.join(BY_NAME)})")
    return engine


def default_engine(dialect: str) -> str | None:
    """The dialect's own choice (Dialect.default_engine): the newest rank-sliced loader for TR3, the fork's R7
    loader for R7, each other container's own reader; None for a dialect no profiled loader reads (a route
    pack)."""
    return dialect_named(dialect).default_engine


def enforced_name(engine: str | None, dialect: str) -> str | None:
    """`DEFAULT` -> the dialect's default profile; None -> no profile enforced; else the named one."""
    if engine is None:
        return None
    return default_engine(dialect) if engine == DEFAULT else engine_named(engine).name


def refusals(engine: Engine, ckpt: Checkpoint, layers: list[int], tp: int | None = None) -> list[r.Refusal]:
    """What `engine` refuses (at server TP `tp` when given); a container it does not read at all ends the list
    (nothing else is looked up)."""
    found: list[r.Refusal] = []
    for rule in engine.rules:
        found.extend(rule(ckpt, layers))
        if any(x.code == CONTAINER for x in found):
            return [x for x in found if x.code == CONTAINER]
    if engine.tp_rule is None:
        return found
    if tp is not None:
        refused = engine.tp_rule(ckpt, tp)
        if refused is not None:
            found.append(refused)
    elif tpc.accepted_tp(engine.tp_rule, ckpt) == []:
        why = engine.tp_rule(ckpt, 2) or engine.tp_rule(ckpt, 1)
        found.append(r.Refusal("engine.tp", "no TP degree loads", why.where if why else r.Location(),
                               f"no TP in 1..{tpc.MAX_TP} passes this loader's TP contract"
                               + (f" (at TP 2: {why.message})" if why else ""), expected="a TP degree", found=None))
    return found



def to_finding(engine: Engine, refusal: r.Refusal) -> Finding:
    return Finding(refusal.code, Severity.ERROR, refusal.where, refusal.message, refusal.expected, refusal.found,
                   engine=engine.name)


def assess(ckpt: Checkpoint, layers: list[int], report: Report, enforced: str | None, tp: int | None = None) -> None:
    """Add the enforced engine's refusals to `report` as errors, then every engine's verdict to report.engines.

    `tp`: the TP the server will run (--tp), checked against each profile's TP contract; without it each verdict
    lists the TP degrees the profile would accept. Call after every other rule has run: a format error (no
    engine) is a refusal of every engine too.
    """
    per_engine = {e.name: refusals(e, ckpt, layers, tp) for e in ENGINES}
    if enforced is not None:
        engine = BY_NAME[enforced]
        report.extend(to_finding(engine, refusal) for refusal in per_engine[enforced])
    format_errors = [f for f in report.errors if f.engine is None]
    report.engines = [_verdict(e, per_engine[e.name], format_errors, enforced, ckpt, tp) for e in ENGINES
                      if e.listed_for(ckpt, enforced)]
    report.context["tp"] = tp


def _verdict(engine: Engine, refused: list[r.Refusal], format_errors: list[Finding], enforced: str | None,
             ckpt: Checkpoint, tp: int | None) -> EngineVerdict:
    dialect = ckpt.dialect
    reasons: list[EngineReason] = [
        {"code": x.code, "reason": x.reason, "message": x.message, "location": x.where.to_dict()} for x in refused]
    if format_errors:
        codes = sorted({f.code for f in format_errors})
        reasons.append({"code": "format", "reason": f"{len(format_errors)} format error(s): {', '.join(codes[:3])}",
                        "message": "errors of the format rules, which every loader refuses", "location": {}})
    verdict: EngineVerdict = {
        "name": engine.name, "label": engine.label, "version": engine.version, "reads": engine.reads,
        "enforced": engine.name == enforced, "default": engine.name == default_engine(dialect),
        "loads": not reasons, "tp": tp, "tp_accepted": _tp_accepted(engine, ckpt, refused),
        "reasons": reasons[:MAX_REASONS]}
    if len(reasons) > MAX_REASONS:
        verdict["more_reasons"] = len(reasons) - MAX_REASONS
    return verdict


def tp_verdicts(ckpt: Checkpoint, tp: int) -> dict[str, TpVerdict]:
    """Each engine that reads this container: whether its TP contract accepts `tp`, and why not (inspect --tp)."""
    out: dict[str, TpVerdict] = {}
    for engine in ENGINES:
        if not engine.listed_for(ckpt) or any(x.code == CONTAINER for rule in engine.rules for x in rule(ckpt, list(ckpt.layers))):
            continue
        refused = engine.tp_rule(ckpt, tp) if engine.tp_rule is not None else None
        out[engine.name] = {"accepts": refused is None, "reason": refused.reason if refused else None}
    return out


def _tp_accepted(engine: Engine, ckpt: Checkpoint, refused: list[r.Refusal]) -> list[int] | str | None:
    """The TP degrees this profile would take; "any" when it sets no limit; None for a container it cannot read."""
    if any(x.code == CONTAINER for x in refused):
        return None
    accepted = tpc.accepted_tp(engine.tp_rule, ckpt)
    return "any" if accepted is None else accepted


def unreadable_verdicts(why: str) -> list[EngineVerdict]:
    """Verdicts for a checkpoint that could not be opened: no engine loads it."""
    return [{"name": e.name, "label": e.label, "version": e.version, "reads": e.reads, "enforced": False,
             "default": False, "loads": False, "tp": None, "tp_accepted": None,
             "reasons": [{"code": "unreadable", "reason": why, "message": why, "location": {}}]} for e in ENGINES
            if e.scope is None]


def compatibility_line(verdicts: list[EngineVerdict], markers_read: bool = True, tp: int | None = None) -> str:
    """`loads on: vllm-exl3 (shared-H rules) ✓ TP 4 · vllm-exl3 (#190 rules) ✗ shared_h_v1 unsupported · ...`

    With `tp` (--tp) the head says which TP was checked; without it each loading engine shows the TP degrees it
    would accept."""
    parts = []
    for v in verdicts:
        text = f"{v['label']} ✓" if v["loads"] else f"{v['label']} ✗ {v['reasons'][0]['reason']}"
        accepted = v["tp_accepted"]
        if v["loads"] and tp is None and isinstance(accepted, list):
            text += f" TP {compact_ranges(accepted)}" if accepted else " at no TP"
        more = len(v["reasons"]) - 1 + v.get("more_reasons", 0)
        if more > 0:
            text += f" (+{more} more)"
        parts.append(text)
    head = "loads on" if markers_read else "loads on (codebook markers not read)"
    if tp is not None:
        head += f" at TP {tp}"
    return f"{head}: " + " · ".join(parts)
