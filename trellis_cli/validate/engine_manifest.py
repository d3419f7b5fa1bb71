"""The checks of the `vllm-exl3-manifest` profile: the fork's newest mainline EXL3 loader, which reads routed
experts only from b12x `exl3-manifest.json` containers (through b12x's own reader) and dense weights as MXFP8.

In short (docs/engines.md has the table with sources): config.json's quantization_config is stamped `exl3`,
names `exl3-manifest.json` under `exl3.manifest` and `mxfp8` as `dense_format`, and lists the layers kept in
BF16 (`ignored_layers`: the KDA gate, factor and beta projections and MLA's kv_b_proj, never q/k/v); the
manifest's geometry matches the model's expert count and hidden size; b12x 1.5.1's trellis adapter takes
uniform rates only; the TP extent plan is engine_tp.manifest_tp. Every other container is refused.
"""

from __future__ import annotations

from typing import Any, Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import VLLM_MANIFEST
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import Location
from trellis_cli.validate.engine_rules import Refusal, container_refusal
from trellis_cli.validate.engine_stamps import STAMP, embedded, text_config

EXL3V1_MANIFEST = "exl3-manifest.json"  # the one container file name this loader opens (b12x's reader's)
DENSE_FORMAT = "mxfp8"
BF16_REQUIRED = ("g_proj", "f_a_proj", "f_b_proj", "b_proj", "kv_b_proj")  # kept in BF16, listed as ignored
MXFP8_REQUIRED = ("q_proj", "k_proj", "v_proj")  # never in ignored_layers
QUANT = Location(file="config.json", tensor="quantization_config")


def manifest_container(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Only an exl3-v1 container: every TR3, R7, plain EXL3 checkpoint or route pack is the wrong container."""
    yield from container_refusal(ckpt, VLLM_MANIFEST)


def manifest_config(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """Exl3Config: the stamp, the container reference, MXFP8 dense weights and the BF16 layer list."""
    q = embedded(ckpt)
    if q is None:
        yield Refusal("engine.quant-config", "no quantization_config in config.json", QUANT, "vLLM selects the "
                      "quantization method from config.json's quantization_config, and there is none",
                      expected="quant_method exl3", found=None)
        return
    if q.get("quant_method") != "exl3":
        yield Refusal("engine.quant-method", f"stamped {q.get('quant_method')!r}", STAMP, "this loader claims "
                      "only a quantization_config stamped exl3", expected="exl3", found=q.get("quant_method"))
    exl3 = q.get("exl3")
    manifest = exl3.get("manifest") if isinstance(exl3, dict) else None
    if manifest != EXL3V1_MANIFEST or q.get("dense_format") != DENSE_FORMAT:
        yield Refusal("engine.manifest-config", "needs exl3.manifest and dense_format mxfp8", QUANT,
                      f"quantization_config must name {EXL3V1_MANIFEST!r} as exl3.manifest (no other file name) "
                      f"and {DENSE_FORMAT!r} as dense_format: the dense weights are read as MXFP8",
                      expected={"exl3": {"manifest": EXL3V1_MANIFEST}, "dense_format": DENSE_FORMAT},
                      found={"exl3": {"manifest": manifest}, "dense_format": q.get("dense_format")})
    ignored = q.get("ignored_layers")
    if not (isinstance(ignored, list) and all(isinstance(x, str) for x in ignored)
            and set(BF16_REQUIRED) <= set(ignored) and not set(MXFP8_REQUIRED) & set(ignored)):
        yield Refusal("engine.manifest-config", "ignored_layers not the BF16 set", Location(
                      file="config.json", tensor="quantization_config.ignored_layers"), "ignored_layers must list "
                      f"{', '.join(BF16_REQUIRED)} (kept in BF16) and none of {', '.join(MXFP8_REQUIRED)}",
                      expected=list(BF16_REQUIRED), found=ignored)


def manifest_geometry(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """The manifest's expert count and hidden size are the model's (config.json)."""
    m, manifest_file = _manifest(ckpt)
    if m is None:
        return
    text = text_config(ckpt)
    experts = next((text.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in text),
                   None)
    model = {"num_experts": experts, "hidden_size": text.get("hidden_size")}
    if model != {"num_experts": m.num_experts, "hidden_size": m.hidden}:
        yield Refusal("engine.manifest-geometry", "manifest geometry differs from the model",
                      Location(file=manifest_file, tensor="geometry"), "the manifest's expert "
                      "count and hidden size must be the model's (config.json)",
                      expected=model, found={"num_experts": m.num_experts, "hidden_size": m.hidden})


def uniform_rates(ckpt: Checkpoint, layers: list[int]) -> Iterator[Refusal]:
    """b12x 1.5.1's trellis adapter (trellis_from_exl3) prepares uniform rates only."""
    m, manifest_file = _manifest(ckpt)
    if m is not None and m.structure != "uniform":
        yield Refusal("engine.manifest-rates", "per-expert rates", Location(file=manifest_file,
                      tensor="rates"), "b12x 1.5.1's trellis adapter takes uniform EXL3 rates only",
                      expected="uniform", found=m.structure)


def _manifest(ckpt: Checkpoint) -> tuple[Any, str | None]:
    """The exl3-v1 manifest of a checkpoint this loader reads and its file name; (None, None) otherwise (or
    when it did not parse)."""
    dialect = dialect_of(ckpt)
    found = dialect.slot_manifest(ckpt) if dialect.container_refusal(VLLM_MANIFEST) is None else None
    return found if found is not None else (None, None)
