"""`trellis synth OUT`: write a synthetic rank-sliced TR3 checkpoint (options -> SynthSpec -> synth)."""

from __future__ import annotations

import dataclasses
import json
import re
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.errors import UsageError

if TYPE_CHECKING:
    from trellis_cli.synth import SynthSummary

# Measured: writing one glm52-tp4 layer (12,288 tensors, 3.97 GB) peaks at about PEAK_RSS_MB of resident
# memory (most of it the torch runtime), because data is generated one linear (<= 1.6 MB) at a time.
PEAK_RSS_MB = 250


class Preset(str, Enum):
    tiny = "tiny"
    glm52_tp4 = "glm52-tp4"
    glm53_flash = "glm53-flash"  # GLM-5.3-Flash's unsliced stream (dialects/glm53/synth.py)
    glm53_tiny = "glm53-tiny"


class Codebook(str, Enum):
    mcg = "mcg"
    mul1 = "mul1"
    inst3 = "3inst"


class Format(str, Enum):
    tr3 = "tr3"
    exl3_v1 = "exl3-v1"


class NonExpert(str, Enum):
    none = "none"
    bf16 = "bf16"


class BitmapField(str, Enum):
    k = "k"
    bits_per_expert = "bits_per_expert"


def parse_layers(text: str) -> tuple[int, ...]:
    """"3-78" -> 3..78; "3,5,7" -> those; "3-5,9" -> 3,4,5,9 (the syntax of every --layers)."""
    from trellis_cli.selection import parse_layer_ranges

    return tuple(parse_layer_ranges(text))


def parse_partition(text: str) -> tuple[int, int]:
    """"192/64" -> (192, 64): experts at the lower and the higher K (selection.parse_partition)."""
    from trellis_cli.selection import parse_partition as parse

    low, high = parse(text, 2)
    return low, high


def parse_k_values(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d)\s*[,/]\s*(\d)\s*", text)
    if not match:
        raise UsageError(f"--k-values: cannot read {text!r} (expected two bitrates, e.g. 3,4)")
    return int(match[1]), int(match[2])


def read_bitmap(path: Path) -> list[int] | dict[int, tuple[int, ...]]:
    """A bitmap file: a per-expert K list (every layer), {layer: [K...]}, or a tier_bitmap.json."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UsageError(f"--bitmap: cannot read {path}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UsageError(f"--bitmap: {path} is not valid JSON ({err})") from None
    if isinstance(document, list):
        return _k_list(path, "the list", document)
    if not isinstance(document, dict) or not document:
        raise UsageError(f"--bitmap: {path} must hold a list of K or a non-empty object keyed by layer")
    per_layer: dict[int, tuple[int, ...]] = {}
    for key, value in document.items():
        if not str(key).isdigit():
            raise UsageError(f"--bitmap: {path}: key {key!r} is not a decimal layer index")
        if isinstance(value, dict):
            value = value.get("k", value.get("bits_per_expert"))
        per_layer[int(key)] = tuple(_k_list(path, f"layer {key}", value))
    return dict(sorted(per_layer.items()))


def _k_list(path: Path, where: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(k, int) and not isinstance(k, bool) for k in value):
        raise UsageError(f"--bitmap: {path}: {where} must be a non-empty list of integer K values")
    return value


def build_spec(preset_name: str, overrides: dict[str, Any], partition: Optional[str], k_values: Optional[str],
               bitmap: Optional[Path], uniform: Optional[int]):
    """The preset with every given option applied on top."""
    from trellis_cli.synth import preset

    spec = preset(preset_name)
    changes = {name: value for name, value in overrides.items() if value is not None}
    if sum(choice is not None for choice in (partition, bitmap, uniform)) > 1:
        raise UsageError("give at most one of --partition, --bitmap, --uniform")
    k_choice: dict[str, Any] = {}
    if partition is not None:
        k_choice = {"partition": parse_partition(partition)}
    elif uniform is not None:
        k_choice = {"uniform_k": uniform}
    elif bitmap is not None:
        k_choice = _bitmap_choice(read_bitmap(bitmap), changes.get("layers", spec.layers))
        if isinstance(k_choice.get("bitmap"), dict) and "layers" not in changes:
            changes["layers"] = tuple(k_choice["bitmap"])
    if k_choice:
        k_choice = {"partition": None, "bitmap": None, "uniform_k": None, **k_choice}
    if k_values is not None:
        if uniform is not None or bitmap is not None:
            raise UsageError("--k-values goes with --partition only")
        k_choice["k_values"] = parse_k_values(k_values)
    if "experts" in changes and not k_choice and spec.partition is not None and sum(spec.partition) != changes["experts"]:
        k_choice = {"partition": scaled_partition(spec.partition, changes["experts"])}
    if "layers" in changes and spec.num_hidden_layers is not None and changes["layers"][-1] >= spec.num_hidden_layers:
        changes["num_hidden_layers"] = None  # the preset's model depth no longer fits the layers asked for
    return dataclasses.replace(spec, **changes, **k_choice)


def scaled_partition(partition: tuple[int, int], experts: int) -> tuple[int, int]:
    """A preset's LOW/HIGH split at another expert count, in the same proportion (192/64 at 64 experts: 48/16);
    both tiers kept non-empty where the count allows."""
    low = round(partition[0] * experts / sum(partition))
    if experts >= 2:
        low = min(max(low, 1), experts - 1)
    return low, experts - low


def _bitmap_choice(bitmap, layers: tuple[int, ...]) -> dict[str, Any]:
    if isinstance(bitmap, list):
        return {"bitmap": {layer: tuple(bitmap) for layer in layers}}
    return {"bitmap": bitmap}


HELP = (
    "Write a synthetic rank-sliced TR3 checkpoint (EXL3 trellis, mixed K per expert) at any geometry.\n\n"
    "Random valid codes with realistic suh/svh, seeded and reproducible. Streams one linear at a time: "
    f"peak memory about {PEAK_RSS_MB} MB even for a glm52-tp4 layer (3.97 GB per shard). "
    "--sparse writes real headers over unwritten data, so the full glm52-tp4 checkpoint "
    "(~300 GB apparent) takes about half a minute and almost no disk. Options override the preset.\n\n"
    "What the presets make: tiny (the default) is a whole toy GLM MoE DSA model, its routed experts and every "
    "other weight an engine loads (attention, indexer, norms, router, shared expert, dense MLP, embeddings, "
    "lm_head) in bf16, so `trellis validate` passes it; glm52-tp4 writes the routed experts only (the ~300 GB "
    "the layout is about), which every engine refuses for its missing weights: add --non-expert bf16 "
    "(with --sparse, headers only) for a checkpoint an engine would load."
)


def synth_command(
    out: Annotated[Path, typer.Argument(help="Output directory (must not exist or be empty).")],
    preset_name: Annotated[Preset, typer.Option("--preset", help="Starting geometry.")] = Preset.tiny,
    hidden: Annotated[Optional[int], typer.Option(help="Hidden size H (multiple of 128).")] = None,
    intermediate: Annotated[Optional[int], typer.Option(help="Global MoE intermediate size.")] = None,
    experts: Annotated[Optional[int], typer.Option(help="Routed experts per layer.")] = None,
    tp: Annotated[Optional[int], typer.Option(help="Tensor-parallel ranks (slices per expert).")] = None,
    layers: Annotated[Optional[str], typer.Option(help="MoE layers, e.g. 3-78 or 3,5.")] = None,
    partition: Annotated[Optional[str], typer.Option(help="LOW/HIGH expert counts, e.g. 192/64.")] = None,
    k_values: Annotated[Optional[str], typer.Option("--k-values", help="The two K of --partition.")] = None,
    bitmap: Annotated[Optional[Path], typer.Option(help="JSON: per-expert K list or {layer: [K...]}.")] = None,
    uniform: Annotated[Optional[int], typer.Option(help="Every expert at this K.")] = None,
    codebook: Annotated[Codebook, typer.Option(help="Codebook marker per linear.")] = Codebook.mcg,
    shared_h: Annotated[bool, typer.Option("--shared-h", help="rotation_layout shared_h_v1.")] = False,
    bitmap_field: Annotated[BitmapField, typer.Option(help="tier_bitmap.json field name.")] = BitmapField.k,
    top_k: Annotated[Optional[int], typer.Option("--top-k", help="Experts per token.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    sparse: Annotated[bool, typer.Option("--sparse", help="Headers only, data left as holes.")] = False,
    non_expert: Annotated[Optional[NonExpert], typer.Option(
        "--non-expert", help="The weights besides the routed experts: none (experts only: no engine loads it) or "
                             "bf16 (every weight the model class loads, as the GLM-5 release stores them; holes "
                             "with --sparse). Default: the preset's (tiny bf16, glm52-tp4 none).")] = None,
    fmt: Annotated[Format, typer.Option("--format", help="tr3 (rank-sliced shards) or exl3-v1 (b12x's "
                                                         "slot-major container; --tp is then ignored).")] = Format.tr3,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
) -> None:
    from trellis_cli import synth

    if preset_name.value.startswith("glm53-"):
        given = {"--tp": tp, "--layers": layers, "--partition": partition, "--k-values": k_values,
                 "--bitmap": bitmap, "--shared-h": shared_h or None, "--format": None if fmt is Format.tr3 else fmt,
                 "--codebook": None if codebook is Codebook.mcg else codebook}
        _write_glm53(out, preset_name.value, [k for k, v in given.items() if v is not None],
                     {"hidden": hidden, "intermediate": intermediate, "experts": experts, "top_k": top_k,
                      "bits": uniform, "seed": seed, "sparse": sparse}, overwrite, as_json)
        return
    overrides = {"hidden": hidden, "intermediate": intermediate, "experts": experts, "tp": tp,
                 "layers": parse_layers(layers) if layers is not None else None, "top_k": top_k,
                 "non_expert": non_expert.value if non_expert is not None else None}
    spec = build_spec(preset_name.value, overrides, partition, k_values, bitmap, uniform)
    spec = dataclasses.replace(spec, codebook=codebook.value, bitmap_field=bitmap_field.value, seed=seed,
                               sparse=sparse, rotation_layout="shared_h_v1" if shared_h else "per_expert_v1")
    if fmt is Format.exl3_v1:
        _write_exl3v1(out, spec, overwrite, as_json)
        return
    from trellis_cli.inspect_report import human_bytes

    synth.check_target(out, overwrite)  # refused before a word about writing it
    size = synth.checkpoint_bytes(spec)
    output.log(f"writing {out}: {len(spec.layers)} layer shards, {human_bytes(size)} of tensor data"
               + (" (sparse: headers only)" if sparse else ""))
    with output.progress_bar("synth layers", len(spec.layers), enabled=output.progress_enabled(as_json)) as advance:
        synth.write_checkpoint(out, spec, lambda _layer: advance(), overwrite=overwrite)
    doc = synth.summary(spec, out)
    if as_json:
        output.emit_json(doc.to_json())
        return
    _print_summary(doc)


def _write_glm53(out: Path, preset: str, refused: list[str], changes: dict, overwrite: bool, as_json: bool) -> None:
    from trellis_cli.dialects.registry import synth_module
    from trellis_cli.inspect_report import human_bytes
    from trellis_cli.synth import check_target

    synth_glm53 = synth_module("glm53-stream")
    if refused:
        raise UsageError(f"synth --preset {preset}: {', '.join(refused)} do not apply (the GLM-5.3 stream is "
                         "unsliced, mcg, with MoE layers from first_k_dense_replace on; --uniform K sets its bits)")
    spec = synth_glm53.preset(preset, **changes)
    check_target(out, overwrite)
    size = synth_glm53.checkpoint_bytes(spec)
    output.log(f"writing {out}: GLM-5.3 unsliced stream, {len(spec.layers)} MoE layer shards, "
               f"{human_bytes(size)} of tensor data" + (" (sparse: headers only)" if spec.sparse else ""))
    with output.progress_bar("synth layers", len(spec.layers), enabled=output.progress_enabled(as_json)) as advance:
        synth_glm53.write_stream_checkpoint(out, spec, lambda _layer: advance(), overwrite=overwrite)
    doc = synth_glm53.summary(spec, out)
    if as_json:
        output.emit_json(doc.to_json())
        return
    layers = doc.layers
    output.print_line(f"wrote {doc.path} (GLM-5.3 unsliced stream{', sparse' if doc.sparse else ''}): "
                      f"MoE layers {layers[0]}-{layers[-1]} ({doc.mtp_layers} MTP), H {doc.hidden}, "
                      f"I {doc.intermediate}, {doc.experts} experts, K{doc.bits} mcg, "
                      f"{doc.tensor_bytes:,} bytes of tensor data")


def _write_exl3v1(out: Path, spec, overwrite: bool, as_json: bool) -> None:
    from trellis_cli.dialects.registry import synth_module

    synth_exl3v1 = synth_module(Format.exl3_v1.value)

    from trellis_cli.inspect_report import human_bytes
    from trellis_cli.synth import check_target

    check_target(out, overwrite)
    size = synth_exl3v1.checkpoint_bytes(spec)
    output.log(f"writing {out}: exl3-v1, {len(spec.layers)} layer files, {human_bytes(size)} of tensor data"
               + (" (sparse: rate tables only)" if spec.sparse else ""))
    with output.progress_bar("synth layers", len(spec.layers), enabled=output.progress_enabled(as_json)) as advance:
        synth_exl3v1.write_checkpoint(out, spec, lambda _layer: advance(), overwrite=overwrite)
    doc = synth_exl3v1.summary(spec, out)
    if as_json:
        output.emit_json(doc.to_json())
        return
    rates = f"uniform K{doc.bits}" if doc.structure == "uniform" else f"per_expert_pair {doc.pair_kinds}"
    output.print_line(f"wrote {doc.path} (exl3-v1{', sparse' if doc.sparse else ''}): {len(doc.layers)} "
                      f"layers, H {doc.hidden}, I {doc.intermediate} ({doc.num_slots} slots), "
                      f"{doc.experts} experts, {rates}, {doc.tensor_bytes:,} bytes of tensor data")


def _print_summary(doc: SynthSummary) -> None:
    from trellis_cli.findings import counted
    from trellis_cli.inspect_report import human_bytes

    layers = doc.layers
    span = f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))
    tiers = sorted({json.dumps(p, sort_keys=True) for p in doc.partitions.values()})
    lines = [
        f"wrote {doc.path}{' (sparse)' if doc.sparse else ''}",
        f"  geometry  H {doc.hidden}, I {doc.intermediate} ({doc.intermediate_per_rank}/rank), "
        f"{doc.experts} experts, TP{doc.tp}, top-{doc.top_k}",
        f"  layers    {span} ({counted(len(layers), 'shards')}, {doc.tensors_per_layer} tensors each)",
        f"  bits      {doc.bits} (mean {doc.mean_bpw} bpw), {doc.codebook}, {doc.rotation_layout}",
        f"  tiers     {'; '.join(tiers)}",
        f"  bytes     {doc.tensor_bytes:,} tensor data ({human_bytes(doc.tensor_bytes)})",
        f"  model     {doc.model_type}: " + (
            f"{doc.non_expert_tensors} weights besides the experts ({doc.non_expert})" if doc.non_expert != "none"
            else "routed experts only: no engine loads it (--non-expert bf16 writes every weight)"),
    ]
    for line in lines:
        output.print_line(line)
