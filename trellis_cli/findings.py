"""Findings: what a check found, where, and expected vs found. Plain data; no rich, no torch.

Every finding has a stable code (documented in docs/findings.md) so that CI pipelines can allow-list
warnings. Rules yield findings and never raise on bad input; the CLI renders a Report.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Iterable


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

    def line(self) -> str:
        by = f" ({self.engine})" if self.engine else ""
        text = f"{self.severity.value}[{self.code}]{by} {self.where}: {self.message}"
        if self.expected is not None or self.found is not None:
            text += f" (expected {self.expected}, found {self.found})"
        return text

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
        return out


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


MAX_MISSING_SHOWN = 50  # per kind and layer; then one finding with the total


def missing_ids(ids: range, present, limit: int = MAX_MISSING_SHOWN) -> tuple[list[int], int]:
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


def warning(code: str, where: Location, message: str, expected: Any = None, found: Any = None) -> Finding:
    return Finding(code, Severity.WARNING, where, message, expected, found)


@dataclass
class Report:
    """All findings of one run, plus what was checked. Complete: every rule runs even after errors."""

    subject: str
    findings: list[Finding] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)  # e.g. {"tensors": 12288, "files": 3}
    context: dict[str, Any] = field(default_factory=dict)  # source, revision, dialect, ...
    engines: list[dict[str, Any]] = field(default_factory=list)  # per-engine verdicts (validate/engines.py)

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

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        checked = ", ".join(f"{n} {what}" for what, n in self.checked.items()) or "nothing"
        verdict = "PASS" if self.ok else "FAIL"
        return (
            f"{verdict}: {self.subject}: {len(self.errors)} error(s), {len(self.warnings)} warning(s); "
            f"checked {checked}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "subject": self.subject,
            "ok": self.ok,
            "summary": self.summary(),
            "context": self.context,
            "checked": self.checked,
            "findings": [f.to_dict() for f in self.findings],
            "engines": self.engines,
        }
