"""Writing exl3-v1: the manifest document and one layer file, its `codes` streamed row by row.

Tensor order in a layer file: rotations and the hidden-side tables (fp16, so every fp16 tensor starts at an
even offset), the rate tables, then `codes` last, so its rows can be written one at a time (or left as a
hole in sparse files). The stride is the longest row payload rounded up to `row_alignment`; the bytes after
a row's bundles are zero.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from trellis_cli.dialects.exl3v1.container import CODES, HIDDEN_TABLES, RATES_FC1, RATES_FC2, ROTATIONS, SIGN_PATTERN
from trellis_cli.dialects.exl3v1.container import expected_metadata, rate_table_shape
from trellis_cli.dialects.exl3v1.layout import LayerRates, row_payloads
from trellis_cli.dialects.exl3v1.schema import KIND, MCG_SEED, SCHEMA, SLOT_CHANNELS, Manifest
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter


def layer_file_name(layer: int) -> str:
    return f"exl3-layer-{layer:05d}.safetensors"


def row_stride(m: Manifest, rates: LayerRates) -> int:
    longest = max(row_payloads(m, rates))
    return -(-longest // m.row_alignment) * m.row_alignment


def layer_plan(m: Manifest, stride: int) -> list[PlannedTensor]:
    hidden_shape = (m.num_experts, m.hidden) if m.per_expert_input_rotations else (m.hidden,)
    plan = [PlannedTensor(ROTATIONS, "F16", (m.num_slots, m.num_experts, 3, SLOT_CHANNELS))]
    plan += [PlannedTensor(name, "F16", hidden_shape) for name in HIDDEN_TABLES]
    if m.pair_structure:
        plan += [PlannedTensor(name, "U8", rate_table_shape(m)) for name in (RATES_FC1, RATES_FC2)]
    if m.intermediate_hadamard:
        plan.append(PlannedTensor(SIGN_PATTERN, "U8", (m.num_experts,)))
    return plan + [PlannedTensor(CODES, "U8", (m.num_slots, stride))]


def write_layer(path: Path, m: Manifest, layer: int, stride: int, tables: Callable[[str], Any],
                rows: Iterable[bytes] | None) -> Path:
    """Write one layer file: `tables(name)` gives each small tensor (None leaves a hole), `rows` the codes rows
    in slot order (each exactly `stride` bytes; None leaves the whole of `codes` as a hole)."""
    plan = layer_plan(m, stride)
    with SafetensorsWriter(path, plan, expected_metadata(m, layer)) as writer:
        for planned in plan[:-1]:
            data = tables(planned.name)
            if data is None:
                writer.skip(planned.name)
            else:
                writer.write(planned.name, data)
        if rows is None:
            writer.skip(CODES)
        else:
            writer.write_parts(CODES, rows)
    return path


def manifest_document(m: Manifest) -> dict[str, Any]:
    """The manifest as JSON data (layers from `m.layers`)."""
    rates: dict[str, Any] = {"structure": m.structure}
    if m.pair_structure:
        rates["pair_kinds"] = list(m.pair_kinds)
    else:
        rates["bits"] = m.bits
    hadamard: dict[str, Any] = {"intermediate_hadamard": m.intermediate_hadamard,
                                "per_expert_input_rotations": m.per_expert_input_rotations}
    if m.intermediate_hadamard:
        hadamard |= {"pre_block": m.pre_block, "post_block": m.post_block}
    doc: dict[str, Any] = {
        "kind": KIND, "schema": SCHEMA, "codebook": m.codebook,
        "geometry": {"num_experts": m.num_experts, "hidden_size": m.hidden, "intermediate_size": m.intermediate,
                     "slot_channels": SLOT_CHANNELS, "num_slots": m.num_slots,
                     "moe_layer_indices": list(m.layer_indices)},
        "rates": rates, "hadamard": hadamard,
        "layout": {"row_alignment": m.row_alignment, "extent_alignment_slots": m.extent_alignment,
                   "extent_barriers": list(m.barriers)},
        "layers": {str(i): {"file": e.file, "sha256": e.sha256} for i, e in sorted(m.layers.items())},
    }
    if m.codebook == "mcg":
        doc["codebook_seed"] = MCG_SEED
    return doc


def write_manifest(directory: Path, m: Manifest, name: str) -> Path:
    """Atomically (temporary name, fsync, rename), as JSON with sorted keys and a trailing newline."""
    path = directory / name
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(manifest_document(m), indent=2, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
