"""Synthetic exl3-v1 checkpoints from a SynthSpec (the geometry and K per expert `trellis synth` already has).

One K for every expert of every layer -> `uniform` rates; several -> `per_expert_pair` with the symmetric
kinds (K3 -> P33, K4 -> P44, K2 -> P22) in every pair of an expert. Codes are seeded random bytes (every int16
pattern is a valid trellis code) with zero row padding; rotations and hidden-side tables are converter-like
fp16. `sparse` writes the rate tables and leaves everything else as holes, so a production-size checkpoint
takes seconds; its manifest then records no real digests (all zeros: there is no data to hash), which
`validate --checksums` reports.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trellis_cli.errors import UsageError
from trellis_cli.dialects.exl3v1.container import HIDDEN_TABLES, RATES_FC1, RATES_FC2, ROTATIONS
from trellis_cli.dialects.exl3v1.layout import LayerRates, row_payload
from trellis_cli.dialects.exl3v1.schema import (HADAMARD_BLOCK_SLOTS, MANIFEST_FILE, MAX_EXPERTS, MAX_HIDDEN,
                                               MAX_SLOT_EXPERTS, MAX_SLOTS, PER_EXPERT_PAIR, SLOT_CHANNELS,
                                               SLOTS_PER_PAIR, UNIFORM, LayerEntry, Manifest)
from trellis_cli.dialects.exl3v1.write import layer_file_name, layer_plan, row_stride, write_layer, write_manifest
from trellis_cli.integrity import sha256_file
from trellis_cli.synth import (NON_EXPERT_SHARD, SynthSpec, _generator, model_config, non_expert_plan, random_suh,
                               random_svh, staged_output, write_non_expert)

SPARSE_DIGEST = "0" * 64
ROW_ALIGNMENT = 4096
PAIR_K = (2, 3, 4)  # K with a symmetric pair kind (P22, P33, P44)


def manifest_for(spec: SynthSpec) -> Manifest:
    ks = spec.declared_k_values()
    if spec.codebook != "mcg":
        raise UsageError(f"synth --format exl3-v1: codebook {spec.codebook} has no exl3-v1 name (use mcg)")
    if spec.intermediate % SLOT_CHANNELS:
        raise UsageError(f"synth --format exl3-v1: intermediate {spec.intermediate} is not a multiple of 32")
    slots = spec.intermediate // SLOT_CHANNELS
    for what, value, limit in (("slots (--intermediate / 32)", slots, MAX_SLOTS),
                               ("experts", spec.experts, MAX_EXPERTS),
                               ("hidden size", spec.hidden, MAX_HIDDEN),
                               ("slots x experts", slots * spec.experts, MAX_SLOT_EXPERTS)):
        if value > limit:  # what validate refuses as exl3v1.too-large: never written
            raise UsageError(f"synth --format exl3-v1: {value} {what} is above the limit of {limit}")
    mixed = len(ks) > 1
    align = SLOTS_PER_PAIR if mixed else HADAMARD_BLOCK_SLOTS
    if slots % align:
        raise UsageError(f"synth --format exl3-v1: {slots} slots is not a multiple of {align} "
                         f"({'8-slot rate pairs' if mixed else '128-channel blocks'})")
    if mixed and any(k not in PAIR_K for k in ks):
        raise UsageError(f"synth --format exl3-v1: mixed K {list(ks)}: pair kinds exist for K2, K3 and K4 only")
    if not mixed and ks[0] not in range(2, 7):
        raise UsageError(f"synth --format exl3-v1: K{ks[0]} is outside the 2..6 that exl3-v1 rates allow")
    return Manifest(codebook="mcg", codebook_seed=None, num_experts=spec.experts, hidden=spec.hidden,
                    intermediate=spec.intermediate, num_slots=slots, layer_indices=tuple(spec.layers),
                    structure=PER_EXPERT_PAIR if mixed else UNIFORM, bits=None if mixed else ks[0],
                    pair_kinds=tuple(f"P{k}{k}" for k in ks) if mixed else (),
                    intermediate_hadamard=False, per_expert_input_rotations=spec.rotation_layout == "per_expert_v1",
                    pre_block=None, post_block=None, row_alignment=ROW_ALIGNMENT, extent_alignment=align, barriers=())


def layer_rates(m: Manifest, spec: SynthSpec, layer: int) -> LayerRates:
    if not m.pair_structure:
        assert m.bits is not None  # uniform rates declare their bits
        return LayerRates((m.bits << 4) | m.bits)
    row = tuple(k * 17 for k in spec.expert_k(layer))  # 0xKK
    table = (row,) * m.pairs
    return LayerRates(None, table, table)


def _tables(m: Manifest, spec: SynthSpec, layer: int, rates: LayerRates, sparse: bool):
    def table(name: str):
        if name in (RATES_FC1, RATES_FC2):
            return torch.tensor(rates.fc1 if name == RATES_FC1 else rates.fc2, dtype=torch.uint8)
        if sparse:
            return None
        gen = _generator(spec.seed, layer, "exl3v1", name)
        if name == ROTATIONS:
            n = m.num_slots * m.num_experts * 3 * SLOT_CHANNELS
            return random_svh(n, gen).reshape(m.num_slots, m.num_experts, 3, SLOT_CHANNELS)
        rows = m.num_experts if m.per_expert_input_rotations else 1
        make = random_svh if name == HIDDEN_TABLES[2] else random_suh
        out = make(rows * m.hidden, gen)
        return out.reshape(rows, m.hidden) if m.per_expert_input_rotations else out
    return table


def _rows(m: Manifest, spec: SynthSpec, layer: int, rates: LayerRates, stride: int):
    for slot in range(m.num_slots):
        payload = row_payload(m, rates, slot)
        gen = _generator(spec.seed, layer, "exl3v1-codes", slot)
        row = torch.zeros(stride, dtype=torch.uint8)
        row[:payload] = torch.randint(0, 256, (payload,), dtype=torch.uint8, generator=gen)
        yield row.numpy().data


def write_exl3v1_checkpoint(out_dir: str | Path, spec: SynthSpec, progress: Callable[[int], None] | None = None,
                            *, overwrite: bool = False) -> Path:
    """Write the exl3-v1 checkpoint of `spec` (staged in OUT.partial, moved into place when complete)."""
    m = manifest_for(spec)

    def write(stage: Path) -> None:
        for layer in spec.layers:
            rates = layer_rates(m, spec, layer)
            stride = row_stride(m, rates)
            path = stage / layer_file_name(layer)
            rows = None if spec.sparse else _rows(m, spec, layer, rates, stride)
            write_layer(path, m, layer, stride, _tables(m, spec, layer, rates, spec.sparse), rows)
            m.layers[layer] = LayerEntry(path.name, SPARSE_DIGEST if spec.sparse else sha256_file(path))
            if progress is not None:
                progress(layer)
        write_manifest(stage, m, MANIFEST_FILE)
        if spec.model:  # the model's architecture next to the container, as a served model directory has it
            config = stage / "config.json"
            config.write_text(json.dumps(model_config(spec), indent=2) + "\n", encoding="utf-8")
        if spec.non_expert != "none":  # the weights besides the experts, beside the container (a served directory)
            write_non_expert(stage / NON_EXPERT_SHARD, spec)

    # Sparse: only the rate tables hold data ([num_slots/8, E] bytes each, within the headroom).
    return staged_output(out_dir, overwrite, write, needed=0 if spec.sparse else checkpoint_bytes(spec))


def checkpoint_bytes(spec: SynthSpec) -> int:
    m = manifest_for(spec)
    total = 0
    for layer in spec.layers:
        stride = row_stride(m, layer_rates(m, spec, layer))
        total += sum(t.nbytes for t in layer_plan(m, stride))
    return total + sum(t.nbytes for t in non_expert_plan(spec))


@dataclass(frozen=True)
class Exl3v1SynthSummary:
    """What `trellis synth --preset ... --format exl3-v1` wrote; its fields in the order of `synth --json`."""

    path: str
    format: str
    hidden: int
    intermediate: int
    experts: int
    num_slots: int
    layers: list[int]
    structure: str  # "uniform" or "per_expert_pair"
    bits: int | None  # uniform only
    pair_kinds: list[str]  # per_expert_pair only
    codebook: str
    per_expert_input_rotations: bool
    mean_bpw: float
    partitions: dict[str, dict[str, int]]  # layer -> "K<k>" -> experts
    tensor_bytes: int
    sparse: bool
    seed: int
    files: list[str]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summary(spec: SynthSpec, out: str | Path) -> Exl3v1SynthSummary:
    m = manifest_for(spec)
    partitions = {str(layer): {f"K{k}": spec.expert_k(layer).count(k) for k in sorted(set(spec.expert_k(layer)))}
                  for layer in spec.layers}
    return Exl3v1SynthSummary(
        path=str(out), format="exl3-v1", hidden=spec.hidden, intermediate=spec.intermediate,
        experts=spec.experts, num_slots=m.num_slots, layers=list(spec.layers), structure=m.structure,
        bits=m.bits, pair_kinds=list(m.pair_kinds), codebook=m.codebook,
        per_expert_input_rotations=m.per_expert_input_rotations, mean_bpw=spec.mean_bpw(),
        partitions=partitions, tensor_bytes=checkpoint_bytes(spec), sparse=spec.sparse,
        seed=spec.seed, files=sorted(p.name for p in Path(out).iterdir()))
write_checkpoint = write_exl3v1_checkpoint  # the name trellis synth calls (Dialect.synth)
