"""`b12x_trellis` version 2: a `quantization_config` block (`quant_method: "b12x_trellis"`) plus the metadata
tensors of b12x's exporter (`b12x-trellis.safetensors`: `b12x_trellis.rate`, the scale tables).

Detected and validated, not converted (no on-disk container for grouped payloads exists). Its own rules
(`rules.py`): each b12x release's parser over the block (the codebook era: `sqg_*` up to b12x 1.3.0, `lut_*`
from 1.5.0; each parser refuses the other's names), the model-level rate tensor's shape, the nibble set of its
codebook, and whether the rates select the atom layout (per-group rates, unequal nibbles, mcg K2/K6, several
lookup K), which runs on sm_103 only and which the released wheels refuse. docs/checkpoint-dialects.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint, Declarations
from trellis_cli.dialects.b12x_trellis import rules
from trellis_cli.dialects.interface import (B12X, B12X_130, EXLLAMAV3, CheckRequest, ContainerRefusal, Dialect,
                                            DialectInfo, Probe)
from trellis_cli.findings import Finding, Location, Report, Severity, error, warning
from trellis_cli.header_records import TensorEntry

DIALECT_B12X_TRELLIS = "b12x_trellis-v2"
METADATA_FILE = "b12x-trellis.safetensors"
RATE_TENSOR = "b12x_trellis.rate"
MAX_RATE_BYTES = 64 << 20  # a rate tensor is read whole: GLM-scale per-group rates are a few MB
FAMILY_ERA = {B12X: rules.RELEASE_151, B12X_130: rules.RELEASE_130}
ATOM_NOTE = ("the atom layout (trellis_atoms), which runs on sm_103 only and ships in no b12x release (its "
             "repository only); the b12x 1.5.1 and 1.3.0 wheels refuse these rates (planning."
             "_validate_trellis_runtime, trellis._local_rate_matrix / _symmetric_bits)")


@dataclass
class B12xTrellisDeclarations(Declarations):
    """The quantization block and what opening reads for its rules: each release's parse of it, the metadata
    file's header metadata and rate tensor entry, and the rate bytes once read."""

    quant: dict[str, Any]  # the quantization config holding quant_method b12x_trellis
    declared_in: str  # "config.json" or "quantization_config.json"
    blocks: dict[str, rules.Block] = field(default_factory=dict)  # release -> its parser's reading
    metadata: dict[str, Any] = field(default_factory=dict)  # b12x-trellis.safetensors' header metadata
    rate: TensorEntry | None = None  # the rate tensor's header entry, when the metadata file holds one
    rate_read: bool = False
    rate_bytes: list[int] | None = None  # None: not on this machine, or larger than trellis reads


def _declared(ckpt: Checkpoint) -> B12xTrellisDeclarations | None:
    declared = ckpt.declared
    return declared if isinstance(declared, B12xTrellisDeclarations) else None


class B12xTrellisDialect(Dialect):
    name = DIALECT_B12X_TRELLIS
    holds_model_weights = False  # the block and its rate tensor; the grouped payloads have no container here
    described_as = "a b12x_trellis v2"
    default_engine = "b12x-exl3-v1"  # the b12x 1.5.x profile: its parser and runtime
    read_by = frozenset({B12X, B12X_130})
    tensor_data = False  # no suh/svh vectors of its own; the rate bytes are read by its own rules

    def detect(self, probe: Probe) -> DialectInfo | None:
        """quant_method b12x_trellis in config.json's quantization_config (the block b12x parses), or in
        quantization_config.json."""
        for where, quant in (("config.json", (probe.config or {}).get("quantization_config")),
                             ("quantization_config.json", probe.quant_config)):
            if isinstance(quant, dict) and quant.get("quant_method") == "b12x_trellis":
                block = quant.get("b12x_trellis")
                codebook = block.get("codebook") if isinstance(block, dict) else None
                return DialectInfo(DIALECT_B12X_TRELLIS, "n/a", 1, codebook if isinstance(codebook, str) else None,
                                   B12xTrellisDeclarations(quant, where))
        return None

    def fill(self, ckpt, probe: Probe, info: DialectInfo) -> bool:
        """The block parsed by each release, the model geometry of config.json, the rate tensor's header."""
        from trellis_cli.checkpoint import reader
        from trellis_cli.errors import CheckFailed

        state = info.declared
        assert isinstance(state, B12xTrellisDeclarations)
        state.blocks = {era.release: rules.parse(state.quant, era) for era in rules.ERAS}
        text = _text_config(ckpt.config)
        ckpt.hidden = _int(text.get("hidden_size"))
        ckpt.intermediate = _int(text.get("moe_intermediate_size"))
        ckpt.num_experts = _int(text.get("n_routed_experts", text.get("num_experts")))
        ckpt.codebook = info.codebook
        if METADATA_FILE in probe.files:
            try:  # through the one reader: a link out, a dangling link, a FIFO or a changed file is named
                header = reader.shard_header(ckpt, METADATA_FILE)
            except CheckFailed as e:
                ckpt.parse_findings.append(error(e.code or "file.header", Location(file=METADATA_FILE), str(e)))
            else:
                ckpt.headers[METADATA_FILE] = header
                state.metadata = header.metadata if isinstance(header.metadata, dict) else {}
                state.rate = header.tensors.get(RATE_TENSOR)
        return True

    def names_reported(self, ckpt) -> set[str]:
        return {METADATA_FILE} & set(ckpt.files)

    def check(self, ckpt, request: CheckRequest, report: Report) -> None:
        report.extend(ckpt.parse_findings)
        report.extend(check_block(ckpt))
        report.count("config blocks", 1)

    def container_refusal(self, family: str) -> ContainerRefusal | None:
        if family == EXLLAMAV3:
            return ContainerRefusal("wrong container", "a b12x_trellis v2 checkpoint: exllamav3 loads quant_method "
                                    "exl3 only", expected="exl3")
        return super().container_refusal(family)

    def loader_refusal(self, ckpt, family: str) -> ContainerRefusal | None:
        """A release's parser refusing the block (the other era's names first), then its runtime refusing an
        atom layout."""
        release = FAMILY_ERA.get(family)
        state = _declared(ckpt)
        if release is None or state is None:
            return None
        block = state.blocks[release]
        if block.problems:
            first = block.problems[0]
            return ContainerRefusal(f"{release} parser: {first.field.rsplit('.', 1)[-1]}",
                                    f"{release}'s TrellisConfig parser refuses it ({first.rule}): {first.message}"
                                    f"{_era_hint(state, release)}", _str(first.expected), _str(first.found),
                                    code="engine.b12x-trellis",
                                    where=Location(file=state.declared_in, tensor=first.field))
        why = rules.atom_reasons(block, _rates(ckpt))
        if why:
            return ContainerRefusal(f"atom layout (sm_103): {why[0]}", f"{release} refuses these rates: {why[0]} "
                                    f"selects {ATOM_NOTE}", "symmetric mcg K3/K4/K5 or one lookup K, no group_size",
                                    why[0], code="engine.b12x-trellis-atoms",
                                    where=Location(file=state.declared_in,
                                                   tensor="quantization_config.b12x_trellis.rate"))
        return None


def check_block(ckpt) -> list[Finding]:
    """Problems every release's parser has (format errors), the era, the rate tensor, where the rates run."""
    state = _declared(ckpt)
    assert state is not None  # its own check: the checkpoint is a b12x_trellis one
    where = state.declared_in
    blocks = state.blocks
    out: list[Finding] = []
    per_release = {release: {(p.rule, p.field) for p in b.problems} for release, b in blocks.items()}
    common = set.intersection(*per_release.values())
    releases = " and ".join(blocks)
    shown: set[tuple[str, str]] = set()
    for p in blocks[rules.RELEASE_151].problems:
        if (p.rule, p.field) in common and (p.rule, p.field) not in shown:
            shown.add((p.rule, p.field))
            out.append(error(f"b12x_trellis.{p.rule}", Location(file=where, tensor=p.field),
                             f"{p.message} (refused by the TrellisConfig parser of {releases})",
                             _str(p.expected), _str(p.found)))
    loads = [release for release, b in blocks.items() if not b.problems]
    if len(loads) == 1:
        out.append(Finding("b12x_trellis.era", Severity.INFO, Location(file=where,
                           tensor="quantization_config.b12x_trellis.codebook"),
                           f"the {_era_name(loads[0])} era: {loads[0]}'s parser reads this block; "
                           f"{_other(blocks, loads[0])}'s refuses it", found=state.quant.get("b12x_trellis", {})
                           .get("codebook")))
    block = blocks[loads[0]] if loads else blocks[rules.RELEASE_151]
    out.extend(_rate_findings(ckpt, state, block))
    why = rules.atom_reasons(block, _rates(ckpt))
    if why and loads:
        out.append(Finding("b12x_trellis.atom-layout", Severity.INFO, Location(file=where,
                           tensor="quantization_config.b12x_trellis.rate"),
                           f"these rates select {ATOM_NOTE} ({'; '.join(why)})"))
    return out


def _rate_findings(ckpt, state: B12xTrellisDeclarations, block: rules.Block) -> list[Finding]:
    ref = state.rate
    if ref is None:
        return [warning("b12x_trellis.rate-missing", Location(file=METADATA_FILE, tensor=RATE_TENSOR),
                        "no rate tensor found (b12x's exporter writes it here): its shape and nibbles were not "
                        "checked")]
    where = Location(file=METADATA_FILE, tensor=RATE_TENSOR)
    if ref.dtype != "U8":
        return [error("b12x_trellis.rate-dtype", where, "the rate tensor is one byte per rate", "U8", ref.dtype)]
    layers = _layer_count(ckpt, state)
    if layers is None or ckpt.num_experts is None or ckpt.intermediate is None or block.granularity is None:
        return [warning("b12x_trellis.rate-shape-unknown", where, "the geometry (config.json num_hidden_layers, "
                        "first_k_dense_replace, n_routed_experts, moe_intermediate_size) or the granularity is not "
                        "readable: the rate tensor's shape was not checked")]
    want = rules.rate_shape(block, layers, ckpt.num_experts, ckpt.intermediate)
    if want is None:
        return [error("b12x_trellis.group-size", Location(file=state.declared_in,
                      tensor="quantization_config.b12x_trellis.rate.group_size"), "rate.group_size must divide "
                      "the intermediate size (TrellisRateConfig.tensor_shape, b12x 1.5.1 and 1.3.0)", f"divides {ckpt.intermediate}",
                      block.group_size)]
    if tuple(ref.shape) != want:
        return [error("b12x_trellis.rate-shape", where, f"the {block.granularity} rate tensor's shape "
                      f"(TrellisRateConfig.tensor_shape of b12x 1.5.1 and 1.3.0, {layers} MoE layers)", list(want), list(ref.shape))]
    rates = _rates(ckpt)
    allowed = rules.NIBBLES.get(block.codebook or "")
    if allowed is None:
        return []
    if rates is None:
        return [warning("b12x_trellis.rate-not-read", where, "the rate bytes are not on this machine (or larger "
                        "than trellis reads): their nibbles and the atom-layout selectors were not checked")]
    bad = [(i, r) for i, r in enumerate(rates) if r >> 4 not in allowed or r & 0xF not in allowed]
    if bad:
        return [error("b12x_trellis.rate-nibble", where, f"{len(bad)} rate byte(s) with a nibble the "
                      f"{block.codebook} codebook does not define; first at flat index {bad[0][0]} (normalize_rates "
                      "of b12x's trellis_atoms, repository only)", f"K{allowed.start}..K{allowed.stop - 1}", f"0x{bad[0][1]:02x}")]
    return []


def _rates(ckpt) -> list[int] | None:
    """The rate bytes, read once from a local file; None when absent, malformed or not local."""
    state = _declared(ckpt)
    if state is None or state.rate is None:
        return None
    if not state.rate_read:
        ref = state.rate
        state.rate_read = True
        if ref.dtype == "U8" and ref.end - ref.begin <= MAX_RATE_BYTES and ckpt.source.root is not None:
            from trellis_cli.checkpoint.model import TensorRef
            from trellis_cli.checkpoint.tensors import read_bytes

            header = ckpt.headers[METADATA_FILE]
            tref = TensorRef(RATE_TENSOR, METADATA_FILE, ref.dtype, ref.shape, ref.begin, ref.end, header.data_start)
            state.rate_bytes = list(read_bytes(ckpt, tref, 0, ref.end - ref.begin))
    return state.rate_bytes


def _layer_count(ckpt, state: B12xTrellisDeclarations) -> int | None:
    """MoE layers: the exporter's `moe_layer_indices` "a..b" (inclusive), else num_hidden_layers minus
    first_k_dense_replace (the exporter's range)."""
    span = state.metadata.get("moe_layer_indices")
    if isinstance(span, str) and ".." in span:
        a, _, b = span.partition("..")
        if a.isdigit() and b.isdigit() and int(b) >= int(a):
            return int(b) - int(a) + 1
    text = _text_config(ckpt.config)
    total, dense = _int(text.get("num_hidden_layers")), _int(text.get("first_k_dense_replace", 0))
    return total - dense if total is not None and dense is not None and total > dense else None


def _text_config(config: Any) -> dict[str, Any]:
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _era_name(release: str) -> str:
    return "lut_* (b12x 1.5.0 and later)" if release == rules.RELEASE_151 else "sqg_* (b12x 1.3.0 and earlier)"


def _other(blocks: dict, release: str) -> str:
    return next(r for r in blocks if r != release)


def _era_hint(state: B12xTrellisDeclarations, release: str) -> str:
    others = [r for r, b in state.blocks.items() if r != release and not b.problems]
    return f"; the block is of the other era, which {others[0]} reads" if others else ""


DIALECT = B12xTrellisDialect()
