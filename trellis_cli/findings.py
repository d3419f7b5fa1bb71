"""Findings: what a check found, where, and expected vs found. Plain data; no rich, no torch.

Every finding has a stable code (documented in docs/findings.md) so that CI pipelines can allow-list
warnings. Rules yield findings and never raise on bad input; the CLI renders a Report.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Iterable, TypedDict


class Severity(str, Enum):
    ERROR = "error"  # cannot be served as declared
    WARNING = "warning"  # servable, but suspicious
    INFO = "info"


@dataclass(frozen=True)
class Location:
    """Where a finding is: any subset of file, layer, expert, projection, rank, tensor."""

    file: str | None = None
    layer: int | None = None
    expert: int | None = None
    projection: str | None = None
    rank: int | None = None
    tensor: str | None = None

    def __str__(self) -> str:
        parts = []
        if self.file:
            parts.append(self.file)
        if self.tensor:
            parts.append(self.tensor)
        else:
            bits = []
            if self.layer is not None:
                bits.append(f"layer {self.layer}")
            if self.expert is not None:
                bits.append(f"expert {self.expert}")
            if self.projection is not None:
                bits.append(self.projection)
            if self.rank is not None:
                bits.append(f"rank {self.rank}")
            if bits:
                parts.append(" ".join(bits))
        return ":".join(parts) if parts else "checkpoint"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Finding:
    code: str  # stable, e.g. "tensor.k-shape"
    severity: Severity
    where: Location
    message: str
    expected: Any = None
    found: Any = None
    engine: str | None = None  # set on findings of a loader profile's rules (validate/engines.py)
    # A summary stands for `count` problems a rule did not list one by one ("... and 12 more missing rank
    # slices in this layer"); every other finding is one problem.
    count: int = 1
    summary: bool = False

    def line(self) -> str:
        by = f" ({self.engine})" if self.engine else ""
        text = f"{self.severity.value}[{self.code}]{by} {self.where}: {self.message}"
        facts = [f"expected {self.expected}"] if self.expected is not None else []
        facts += [f"found {self.found}"] if self.found is not None else []
        return f"{text} ({', '.join(facts)})" if facts else text

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "code": self.code,
            "severity": self.severity.value,
            "location": self.where.to_dict(),
            "message": self.message,
        }
        if self.expected is not None:
            out["expected"] = _jsonable(self.expected)
        if self.found is not None:
            out["found"] = _jsonable(self.found)
        if self.engine is not None:
            out["engine"] = self.engine
        if self.summary:
            out.update(summary=True, count=self.count)
        return out


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


MAX_MISSING_SHOWN = 50  # per kind and layer; then one finding with the total
MAX_FINDINGS_PER_CODE = 50  # then counted, not listed: a missing shard must not print 12,288 lines


def missing_ids(ids: range, present: Iterable[int], limit: int = MAX_MISSING_SHOWN) -> tuple[list[int], int]:
    """The first `limit` ids of `ids` not in `present` (a set or dict), and how many are missing in all.

    Costs O(len(present) + limit), not O(len(ids)): `ids` comes from a declared count, which can be huge.
    """
    first: list[int] = []
    if limit > 0:
        for i in ids:
            if i not in present:
                first.append(i)
                if len(first) == limit:
                    break
    return first, len(ids) - sum(1 for p in present if p in ids)


def error(code: str, where: Location, message: str, expected: Any = None, found: Any = None) -> Finding:
    return Finding(code, Severity.ERROR, where, message, expected, found)


def summary_finding(code: str, severity: Severity, where: Location, count: int, message: str, expected: Any = None,
                    found: Any = None) -> Finding:
    """One finding standing for `count` problems of `code` that are not listed one by one."""
    return Finding(code, severity, where, f"... and {count} more {message}", expected, found, count=count,
                   summary=True)


def error_summary(code: str, where: Location, count: int, message: str, expected: Any = None,
                  found: Any = None) -> Finding:
    return summary_finding(code, Severity.ERROR, where, count, message, expected, found)


def warning(code: str, where: Location, message: str, expected: Any = None, found: Any = None) -> Finding:
    return Finding(code, Severity.WARNING, where, message, expected, found)


class ReportCounts(TypedDict):
    """`Report.counts()`: the true totals per severity (in Severity's order), then per code and severity."""

    error: int
    warning: int
    info: int
    by_code: dict[str, dict[str, int]]


class EngineReason(TypedDict):
    """Why one loader profile refuses the checkpoint (a verdict's `reasons`)."""

    code: str
    reason: str
    message: str
    location: dict[str, Any]  # Location.to_dict(); {} where no one place is meant


class _EngineVerdictFields(TypedDict):
    name: str
    label: str
    version: int
    reads: str
    enforced: bool  # the profile whose refusals are the report's errors
    default: bool  # the dialect's own default profile
    loads: bool
    tp: int | None  # the TP asked for (--tp), None when not given
    tp_accepted: list[int] | str | None  # the TP degrees it would take; "any"; None: it cannot read the container
    reasons: list[EngineReason]  # at most MAX_REASONS (validate/engines.py)


class EngineVerdict(_EngineVerdictFields, total=False):
    """One loader profile's verdict in `Report.engines`, in the key order of the JSON report."""

    more_reasons: int  # reasons beyond those listed


class TpVerdict(TypedDict):
    """One engine's answer to `inspect --tp N`: does its TP contract accept N, and why not."""

    accepts: bool
    reason: str | None


@dataclass
class Report:
    """All findings of one run, plus what was checked. Complete: every rule runs even after errors.

    `findings` is what the human view lists; `omitted` counts, per (code, severity), the findings the cap left
    out of that list (kept in `unlisted`), so that `counts()` and the verdict are the true totals and the JSON
    document (`to_dict`) carries every finding.
    """

    subject: str
    findings: list[Finding] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)  # e.g. {"tensors": 12288, "files": 3}
    context: dict[str, Any] = field(default_factory=dict)  # source, revision, dialect, ...
    engines: list[EngineVerdict] = field(default_factory=list)  # per-engine verdicts (validate/engines.py)
    omitted: dict[tuple[str, Severity], int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what was not checked, said beside the verdict
    strict: bool = False  # warnings fail too (`validate --strict`): `ok` is what the exit code says
    unlisted: list[Finding] = field(default_factory=list)  # left out of the human listing by the cap

    def every_finding(self) -> list[Finding]:
        """Listed and unlisted findings together, in a stable order (see `finding_order`)."""
        return sorted([*self.findings, *self.unlisted], key=finding_order)

    def extend(self, items: Iterable[Finding]) -> None:
        self.findings.extend(items)

    def count(self, what: str, n: int = 1) -> None:
        self.checked[what] = self.checked.get(what, 0) + n

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.ERROR]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity is Severity.WARNING]

    def counts(self) -> ReportCounts:
        """The true totals per severity and per code (listed findings, summaries' counts and the omitted)."""
        by_code: dict[str, dict[str, int]] = {}
        totals = {s.value: 0 for s in Severity}

        def add(code: str, severity: Severity, n: int) -> None:
            per = by_code.setdefault(code, {})
            per[severity.value] = per.get(severity.value, 0) + n
            totals[severity.value] += n

        for f in self.findings:
            add(f.code, f.severity, f.count)
        for (code, severity), n in self.omitted.items():
            add(code, severity, n)
        return {"error": totals["error"], "warning": totals["warning"], "info": totals["info"],
                "by_code": dict(sorted(by_code.items()))}

    @property
    def error_count(self) -> int:
        return self.counts()["error"]

    @property
    def warning_count(self) -> int:
        return self.counts()["warning"]

    @property
    def ok(self) -> bool:
        return self.error_count == 0 and not (self.strict and self.warning_count > 0)

    def summary(self) -> str:
        checked = ", ".join(counted(n, what) for what, n in self.checked.items()) or "nothing"
        verdict = "PASS" if self.ok else "FAIL"
        counts = self.counts()
        text = (f"{verdict}: {self.subject}: {counts['error']} error(s), {counts['warning']} warning(s); "
                f"checked {checked}")
        return text + "".join(f"; {note}" for note in self.notes)

    def omitted_lines(self) -> list[tuple[Severity, str]]:
        """One line per capped code: how many more there are, and the total."""
        totals = self.counts()["by_code"]
        return [(severity, f"{severity.value}[{code}] ... and {n} more {code} finding(s) not listed "
                           f"({totals[code][severity.value]} in all)")
                for (code, severity), n in self.omitted.items()]

    def to_dict(self, *, with_findings: bool = True) -> dict[str, Any]:
        """The whole report as plain data; "findings" holds every finding, the capped ones included.

        `with_findings=False` leaves "findings" out, for a writer that streams them (`every_finding`)."""
        document: dict[str, Any] = {
            "subject": self.subject,
            "ok": self.ok,
            "summary": self.summary(),
            "context": self.context,
            "checked": self.checked,
            "notes": self.notes,
            "counts": self.counts(),
            "findings": [f.to_dict() for f in self.every_finding()] if with_findings else None,
            "engines": self.engines,
        }
        if not with_findings:
            del document["findings"]
        return document


def counted(n: int, what: str) -> str:
    """"1 layer", "2 layers", "1 byte hashed": a count with its noun (given in the plural) agreeing."""
    if n != 1:
        return f"{n} {what}"
    words = what.split(" ")
    noun = next((i for i in range(len(words) - 1, -1, -1) if words[i].endswith("s") and words[i] != "hashed"), None)
    if noun is not None:
        words[noun] = words[noun][:-1]
    return f"{n} {' '.join(words)}"


_NUMBER = re.compile(r"(\d+)")


def natural_key(text: str | None) -> tuple[str | tuple[int, str], ...]:
    """`experts.2` before `experts.10`: digit runs compare as numbers, by length then digits (never converted to
    int, so a name from a checkpoint with thousands of digits sorts too)."""
    return tuple((len(part.lstrip("0")), part.lstrip("0")) if i % 2 else part
                 for i, part in enumerate(_NUMBER.split(text or "")))


_SEVERITY_ORDER = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}


def finding_order(f: Finding) -> tuple[Any, ...]:
    """Errors first, then by code, file, layer, expert, projection, rank and tensor (numbers as numbers)."""
    w = f.where
    return (_SEVERITY_ORDER[f.severity], f.code, natural_key(w.file), -1 if w.layer is None else w.layer,
            -1 if w.expert is None else w.expert, w.projection or "", -1 if w.rank is None else w.rank,
            natural_key(w.tensor), f.summary)
