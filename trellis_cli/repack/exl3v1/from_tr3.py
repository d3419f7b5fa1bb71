"""`trellis repack TR3 OUT --to exl3-v1`: rank-sliced TR3 -> one exl3-v1 layer file per MoE layer.

Exact or refused. exl3-v1 holds one hidden-side vector per layer (and expert, for per_expert_v1), with no
rank axis, so every rank's gate/up suh and down svh must be byte-identical; that is checked for every
selected layer before anything is written. Uniform K -> `uniform` rates; several K -> `per_expert_pair`
with P{K}{K} in every pair of an expert, in record-major placement. Per layer: the intermediate vectors
(small) first, then the codes rows one rank at a time from that rank's LayerPack (memory: one layer-rank),
then the written file is read back through the exl3-v1 reader and compared with the source rank by rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import PROJECTIONS, Checkpoint
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.dialects.exl3v1.container import HIDDEN_TABLES, RATES_FC1, RATES_FC2, ROTATIONS, Exl3Layer
from trellis_cli.formats.exl3v1_layout import LayerRates, slot_channels
from trellis_cli.dialects.exl3v1.pack import NOTE_KEY, pack_rows, read_extent_pack
from trellis_cli.formats.exl3v1_schema import (MANIFEST_FILE, PER_EXPERT_PAIR, SLOT_CHANNELS, SLOTS_PER_PAIR, UNIFORM,
                                       LayerEntry, Manifest)
from trellis_cli.dialects.exl3v1.write import layer_file_name, row_stride, write_layer, write_manifest
from trellis_cli.routepack.pack import HIDDEN_SIDE, expected_hidden, expected_intermediate, layer_tiers, pack_layer
from trellis_cli.routepack.plan import parse_selection, rank_pieces
from trellis_cli.routepack.compare import same_bits
from trellis_cli.repack.exl3v1.carry import carried_files, write_carried
from trellis_cli.repack.result import RepackResult, Validator
from trellis_cli.repack.source_facts import SourceHashes, protected_paths, vector_ndim
from trellis_cli.repack.staged_run import NOT_VALIDATED, Driver, OutputPlan, Progress
from trellis_cli.repack.staging import Stage, refuse_collisions
from trellis_cli.routepack.manifest import file_entry
from trellis_cli.routepack.source_bytes import TensorReader

PAIR_K = (2, 3, 4)


def target_manifest(ck: Checkpoint, tiers: dict[int, list[tuple[int, list[int]]]]) -> Manifest:
    ks = sorted({k for layer_tiers_ in tiers.values() for k, _ in layer_tiers_})
    codebooks = {lin.codebook for li in tiers for projs in ck.layers[li].experts.values() for ranks in projs.values()
                 for lin in ranks.values()}
    if codebooks != {"mcg"}:
        raise UsageError(f"--to exl3-v1: the experts use codebook(s) {sorted(codebooks)}; exl3-v1 names mcg only")
    per_rank = ck.intermediate // ck.tp
    mixed = len(ks) > 1
    if mixed and (per_rank % (SLOTS_PER_PAIR * SLOT_CHANNELS) or any(k not in PAIR_K for k in ks)):
        raise UsageError(f"--to exl3-v1: mixed K {ks} needs per_expert_pair rates: K2..K4 and whole 256-channel "
                         f"pairs per rank ({per_rank} intermediate channels per rank)")
    if not mixed and ks[0] not in range(2, 7):
        raise UsageError(f"--to exl3-v1: K{ks[0]} is outside the 2..6 that exl3-v1 rates allow")
    return Manifest(codebook="mcg", num_experts=ck.num_experts, hidden=ck.hidden, intermediate=ck.intermediate,
                    num_slots=ck.intermediate // SLOT_CHANNELS, layer_indices=tuple(tiers),
                    structure=PER_EXPERT_PAIR if mixed else UNIFORM, bits=None if mixed else ks[0],
                    pair_kinds=tuple(f"P{k}{k}" for k in ks) if mixed else (), intermediate_hadamard=False,
                    per_expert_input_rotations=ck.rotation_layout == "per_expert_v1", pre_block=None,
                    post_block=None, row_alignment=4096, extent_alignment=SLOTS_PER_PAIR if mixed else 4,
                    barriers=(), codebook_seed=None)


def rates_for(m: Manifest, tiers: list[tuple[int, list[int]]]) -> LayerRates:
    if not m.pair_structure:
        return LayerRates((m.bits << 4) | m.bits)
    k_of = {e: k for k, ids in tiers for e in ids}
    row = tuple(17 * k_of[e] for e in range(m.num_experts))
    return LayerRates(None, (row,) * m.pairs, (row,) * m.pairs)


def check_hidden_side_equal(ck: Checkpoint, layers: list[int]) -> None:
    """Refuse (before writing) the first layer, expert, projection and rank whose hidden-side vector differs."""
    import torch

    shared = ck.rotation_layout == "shared_h_v1"
    with TensorReader(ck.source) as reader:
        for li in layers:
            moe = ck.layers[li]
            for e in ([0] if shared else sorted(moe.experts)):
                for proj in PROJECTIONS:
                    first = expected_hidden(reader, moe, e, proj, rank_pieces(ck.intermediate, ck.tp, ck.tp, 0),
                                            ck.hidden, shared).view(torch.int16)
                    for rank in range(1, ck.tp):
                        pieces = rank_pieces(ck.intermediate, ck.tp, ck.tp, rank)
                        other = expected_hidden(reader, moe, e, proj, pieces, ck.hidden, shared).view(torch.int16)
                        if not torch.equal(first, other):
                            at = int((first != other).nonzero()[0])
                            who = f"layer {li}" + ("" if shared else f" expert {e}")
                            raise CheckFailed(
                                f"[exl3v1.h-side-differs] {who} {proj} {HIDDEN_SIDE[proj]}: rank {rank} differs from "
                                f"rank 0 (first at element {at}); exl3-v1 holds one hidden-side vector per "
                                f"{'layer' if shared else 'layer and expert'}, and each rank's trellis codes were "
                                "chosen under its own vector, so only re-quantization could merge them (refused, "
                                "nothing written)")


def _small_tables(ck: Checkpoint, m: Manifest, li: int, tiers) -> dict[str, Any]:
    """rotations [S, E, 3, 32] from every rank's intermediate vectors, hidden-side tables from rank 0."""
    import torch

    moe, shared = ck.layers[li], ck.rotation_layout == "shared_h_v1"
    width = ck.intermediate // ck.tp
    count = width // SLOT_CHANNELS
    channels = torch.tensor([c for j in range(count) for c in slot_channels(m, j)])
    rotations = torch.empty((m.num_slots, m.num_experts, 3, SLOT_CHANNELS), dtype=torch.float16)
    rows = m.num_experts if m.per_expert_input_rotations else 1
    hidden = {name: torch.empty((rows, m.hidden), dtype=torch.float16) for name in HIDDEN_TABLES}
    with TensorReader(ck.source) as reader:
        for rank in range(ck.tp):
            pieces = rank_pieces(ck.intermediate, ck.tp, ck.tp, rank)
            for e in range(m.num_experts):
                for p, proj in enumerate(PROJECTIONS):
                    vec = expected_intermediate(reader, moe, e, proj, pieces, width, shared)
                    rotations[rank * count:(rank + 1) * count, e, p] = vec[channels].view(count, SLOT_CHANNELS)
                    if rank == 0 and e < rows:
                        hidden[HIDDEN_TABLES[p]][e] = expected_hidden(reader, moe, e, proj, pieces, m.hidden, shared)
    tables = {ROTATIONS: rotations}
    tables.update({n: t if m.per_expert_input_rotations else t.reshape(m.hidden) for n, t in hidden.items()})
    return tables


def write_converted_layer(ck: Checkpoint, m: Manifest, li: int, tiers, path: Path, on_bytes) -> None:
    rates = rates_for(m, tiers)
    stride = row_stride(m, rates)
    tables = _small_tables(ck, m, li, tiers)
    if m.pair_structure:
        import torch

        tables[RATES_FC1] = torch.tensor(rates.fc1, dtype=torch.uint8)
        tables[RATES_FC2] = torch.tensor(rates.fc2, dtype=torch.uint8)

    def rows():
        with TensorReader(ck.source) as reader:
            for rank in range(ck.tp):
                pack = pack_layer(ck, li, rank, reader=reader)
                for row in pack_rows(m, rates, pack, stride):
                    yield row
                    on_bytes(len(row))
                del pack

    write_layer(path, m, li, stride, tables.get, rows())
    verify_layer_file(ck, m, li, rates, path)


def verify_layer_file(ck: Checkpoint, m: Manifest, li: int, rates: LayerRates, path: Path) -> None:
    """Read the written file back through the exl3-v1 reader; every rank's pack must equal the source's."""
    from trellis_cli.checkpoint.model import TensorRef
    from trellis_cli.header import read_local_header
    from trellis_cli.sources import LocalSource

    header = read_local_header(path, path.name)
    layer = Exl3Layer(li, path.name, "", {n: TensorRef(n, path.name, e.dtype, e.shape, e.begin, e.end,
                                                       header.data_start) for n, e in header.tensors.items()},
                      header.metadata, True)
    with TensorReader(LocalSource(path.parent)) as written, TensorReader(ck.source) as source:
        for rank in range(ck.tp):
            got = read_extent_pack(m, layer, rates, written, ck.tp, rank)
            want = pack_layer(ck, li, rank, reader=source)
            pairs = [("tier_k", got.tier_k == want.tier_k), ("global_to_combined", same_bits(
                got.global_to_combined, want.global_to_combined)), ("descriptors", same_bits(
                got.descriptors, want.descriptors)), ("rot.intermediate", same_bits(
                got.rot_intermediate, want.rot_intermediate))]
            pairs += [(f"tier{t}.trellis", same_bits(a, b)) for t, (a, b) in
                      enumerate(zip(got.tier_trellis, want.tier_trellis))]
            pairs += [(n, same_bits(getattr(got, n), getattr(want, n))) for n in HIDDEN_TABLES]
            bad = [name for name, ok in pairs if not ok]
            if bad:
                raise CheckFailed(f"{path.name}: rank {rank}: {bad[0]} read back differs from the TR3 source")


class Tr3ToExl3v1(Driver):
    """TR3 -> exl3-v1, one layer file per selected MoE layer (see the module docstring)."""

    def __init__(self, ck: Checkpoint, out: Path, options: Any, validator: Validator) -> None:
        if options.tp is not None or options.ranks is not None or options.shared_h:
            raise UsageError("--tp, --ranks and --shared-h do not apply with --to exl3-v1 (it has no rank axis)")
        self.ck, self.out, self.opt, self.validator = ck, out, options, validator
        self.layers = parse_selection(options.layers, [li for li, moe in ck.layers.items() if moe.experts], "layers")

    def plan(self) -> OutputPlan:
        """The rates exl3-v1 can declare for these K (mixed K: whole 256-channel pairs per rank), the codebook and
        the carried files, refused here; sizes: each layer file as its source shard's data (the codes it holds,
        and fewer vectors), the carried files as they are."""
        ck, layers = self.ck, self.layers
        self.tiers = {li: layer_tiers(ck, li) for li in layers}
        self.m = target_manifest(ck, self.tiers)
        self.copies = carried_files(ck, self.opt.copy_other)
        refuse_collisions([(MANIFEST_FILE, "the exl3-v1 manifest"), ("config.json", "the carried config.json")]
                          + [(layer_file_name(li), f"the exl3-v1 file of layer {li}") for li in layers]
                          + [(name, f"source file {name}") for name in self.copies], [])
        layer_bytes = _output_bytes(ck, layers)
        files: list[dict[str, Any]] = [{"name": layer_file_name(li), "bytes_planned": _output_bytes(ck, [li])}
                                       for li in layers]
        files += [{"name": n, "bytes": max(ck.files.get(n, 0), 0)} for n in self.copies]
        files += [{"name": "config.json"}, {"name": MANIFEST_FILE}]
        copied = sum(max(ck.files.get(n, 0), 0) for n in self.copies)
        return OutputPlan(conversion=f"{ck.dialect} -> exl3-v1", out=self.out, protected=protected_paths(ck),
                          fingerprint=_fingerprint(ck, layers), files=files, bytes_needed=layer_bytes + copied,
                          progress_total=layer_bytes, selection={"layers": layers},
                          notes=[NOT_VALIDATED, "layer files planned at their source shards' size (exl3-v1 holds "
                                 "the same codes and fewer vectors)"])

    def data_checks(self) -> None:
        check_hidden_side_equal(self.ck, self.layers)

    def write(self, stage: Stage, result: RepackResult, on_bytes: Progress) -> None:
        ck, m = self.ck, self.m
        hashes = SourceHashes(ck)
        for li in self.layers:
            name, sources = layer_file_name(li), hashes.of(ck.layers[li].files)
            if not stage.completed(name, sources):
                path = stage.file(name, f"the exl3-v1 file of layer {li}")
                write_converted_layer(ck, m, li, self.tiers[li], path, on_bytes)
                stage.record(name, file_entry(path), sources)
                result.files_written += 1
                result.bytes_written += path.stat().st_size
            else:
                result.files_resumed += 1
            m.layers[li] = LayerEntry(name, stage.done[name]["sha256"])
        note = {"source_dialect": ck.dialect, "tp": ck.tp, "vector_ndim": vector_ndim(ck),
                "shard_names": {str(li): sorted(ck.layers[li].files)[0] for li in self.layers}}
        write_carried(ck, stage.path, self.copies, NOTE_KEY, note)
        for name in self.copies:
            hashes.check_copy(name, stage.path / name)
        write_manifest(stage.path, m, MANIFEST_FILE)

    def verify(self, tree: Path) -> None:
        _final_check(tree, self.validator)


def _fingerprint(ck: Checkpoint, layers: list[int]) -> dict:
    return {"source": ck.source.describe(), "to": "exl3-v1", "layers": layers}


def _output_bytes(ck: Checkpoint, layers: list[int]) -> int:
    return sum(ck.headers[f].data_end for li in layers for f in ck.layers[li].files if f in ck.headers)


def _final_check(root: Path, validator: Validator) -> None:
    from trellis_cli.dialects import open_checkpoint

    report = validator(open_checkpoint(root))
    if not report.ok:
        raise CheckFailed(f"{root}: the staged exl3-v1 output does not validate: {report.errors[0].line()}")


__all__ = ["NOTE_KEY", "Tr3ToExl3v1", "check_hidden_side_equal"]
