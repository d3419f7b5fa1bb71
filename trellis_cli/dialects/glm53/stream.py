"""The GLM-5.3 unsliced stream and TR3, both ways: `repack STREAM --to tr3 [--tp N]` and
`repack TR3 --to glm53-stream`. Exact or refused; what each side holds is the glm53 dialect's writer
(dialects/glm53/write.py), the staging (lock, OUT.partial, free space, the move into place) is the staged run's (staged_run.py): these
are its two drivers, `stream_to_tr3` (the TR3 driver over the stream) and `Tr3ToStream`.

To TR3 the stream's full-width experts are cut into rank slices by the same packer every TR3 re-slice uses
(`pack_layer` at the target TP), written by the TR3 writer and read back against those packs; any TP whose
per-rank intermediate slice is whole 128-channel blocks (I 2048: TP 1, 2, 4, 8, 16). Onward, a route pack or
exl3-v1 is made from that TR3 (`repack TR3 --to route-pack | exl3-v1`), each conversion exact or refused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.glm53.container import is_routed_name
from trellis_cli.dialects.glm53.contract import FIXED_TP, SLICE_QUANTUM, moe_layers, text_config
from trellis_cli.dialects.glm53.rules import declared_bits
from trellis_cli.dialects.glm53.write import (CONFIG, QUANT_CONFIG, StreamOutput, note_of, routed_placement,
                                             tr3_config)
from trellis_cli.dialects.tr3.shard import Tr3Layer
from trellis_cli.dialects.tr3.write import Tr3Output, assign_shards
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.integrity import CHECKSUM_MANIFEST
from trellis_cli.dialects.conversion import RepackResult, Validator, check_output
from trellis_cli.dialects.source_facts import SourceHashes, protected_paths
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.dialects.conversion import refuse_collisions
from trellis_cli.dialects.conversion import NOT_VALIDATED, Driver, OutputPlan, Progress
from trellis_cli.dialects.tr3.driver import Tr3Driver, fingerprint_options
from trellis_cli.dialects import carry
from trellis_cli.dialects.shard_pack import pack_layer
from trellis_cli.selection import parse_selection

INDEX = "model.safetensors.index.json"


def _refuse_options(options) -> None:
    if options.ranks is not None or options.shared_h:
        raise UsageError("--ranks and --shared-h do not apply between a GLM-5.3 stream and TR3 (a TR3 shard holds "
                         "every rank; the stream's hidden-side vectors are per expert)")


def target_tp(ck: Checkpoint, tp: int | None) -> int:
    """--tp, else the scope's TP 2; refused unless each rank's intermediate slice is whole 128-channel blocks."""
    tp = FIXED_TP if tp is None else tp
    inter = ck.intermediate or 0
    if tp < 1 or inter % tp or (inter // tp) % SLICE_QUANTUM:
        ok = [n for n in range(1, inter // SLICE_QUANTUM + 1) if inter % n == 0 and (inter // n) % SLICE_QUANTUM == 0]
        raise UsageError(f"--tp {tp}: text_config.moe_intermediate_size {inter} / {tp} is not whole "
                         f"{SLICE_QUANTUM}-channel blocks per rank (the fork's R7-era exl3.py refuses it: "
                         f"_validate_moe_shapes); this stream cuts at TP {ok}")
    return tp


def stream_to_tr3(ck: Checkpoint, out: Path, options, validator: Validator) -> Driver:
    """The stream cut into TR3 rank slices at --tp (the staged run writes it through the TR3 driver)."""
    _refuse_options(options)
    tp = target_tp(ck, options.tp)
    k = declared_bits(ck)
    if k is None:
        raise UsageError("--to tr3: the stream declares no whole bits K (validate names the field)")
    present = [li for li, moe in ck.layers.items() if moe.experts]
    layers = parse_selection(options.layers, present, "layers")
    if layers != list(range(layers[0], layers[-1] + 1)):
        raise UsageError(f"--to tr3: layers {layers} are not contiguous; TR3 declares its MoE layers as one span")
    config_text = ck.source.local_path(CONFIG).read_text(encoding="utf-8")
    quant_text = ck.source.local_path(QUANT_CONFIG).read_text(encoding="utf-8") if QUANT_CONFIG in ck.files else None
    hidden, intermediate = ck.moe_sizes()
    specs = {li: Tr3Layer(li, {e: k for e in sorted(ck.layers[li].experts)}, tp, hidden, intermediate // tp,
                          "mcg", False, 1, 1) for li in layers}
    mixed_files = {f: h for f, h in ck.headers.items() if any(map(is_routed_name, h.tensors))}
    carried = {f: carry.refs_of(h, [n for n in h.tensors if not is_routed_name(n)]) for f, h in mixed_files.items()}
    carried = {f: refs for f, refs in carried.items() if refs}
    skipped = {CONFIG, QUANT_CONFIG, INDEX, CHECKSUM_MANIFEST}
    plan = Tr3Output(
        specs=specs, packs=lambda li, rank: pack_layer(ck, li, rank, tp=tp),
        shards=assign_shards({li: sorted(ck.layers[li].files) for li in layers}),
        carried=carried, carried_source=ck.source,
        metadata={name: header.metadata for name, header in ck.headers.items()},
        copied={n: ck.source.local_path(n) for n in ck.files if n not in skipped and n not in mixed_files},
        config=tr3_config(config_text, quant_text, layers, tp, k, routed_placement(ck, layers)),
        read_copied=ck.source.read_json,
        source_root=protected_paths(ck),
        fingerprint={"source": ck.source.describe(), "options": fingerprint_options(options), "tp": tp})
    hashes = SourceHashes(ck)
    plan.check_copy = hashes.check_copy
    plan.final_check = lambda tree: check_output(tree, validator, "TR3")
    plan.sources = lambda shard: hashes.of(
        {f for li in plan.shards.get(shard, []) for f in ck.layers[li].files} | ({shard} & set(carried)))
    return Tr3Driver(f"{ck.dialect} -> tr3", out, plan)


class Tr3ToStream(Driver):
    """A TR3 form of the stream joined back into the unsliced stream, the files of its note."""

    def __init__(self, ck: Checkpoint, out: Path, options, validator: Validator) -> None:
        _refuse_options(options)
        if options.tp is not None:
            raise UsageError("--tp does not apply with --to glm53-stream (the stream is unsliced)")
        self.ck, self.out, self.validator = ck, out, validator
        self.note = note_of(ck)
        import json

        layers = parse_selection(options.layers, [li for li, moe in ck.layers.items() if moe.experts], "layers")
        expected = moe_layers(text_config(json.loads(self.note["config_json"]))) or []
        if layers != expected:
            raise UsageError(f"--to glm53-stream: the stream's config declares MoE layers {expected[:1]}.."
                             f"{expected[-1:]}; a stream of layers {layers} would not be the checkpoint its config "
                             "describes")
        self.layers = layers
        self.output = StreamOutput(ck, layers, self.note)
        self.hashes = SourceHashes(ck)
        self.notes = [NOT_VALIDATED]  # shown by a dry run, which validates nothing

    def plan(self) -> OutputPlan:
        refuse_collisions(self.output.claims(), [])
        total = self.output.output_bytes()
        return OutputPlan(conversion=f"{self.ck.dialect} -> glm53-stream", out=self.out,
                          protected=list(protected_paths(self.ck)),
                          fingerprint={"source": self.ck.source.describe(), "to": "glm53-stream",
                                       "layers": self.layers},
                          files=[{"name": shard} for shard in self.output.shards], bytes_needed=total,
                          progress_total=total, selection={"layers": self.layers}, notes=self.notes)

    def write(self, stage: StagedOutput, result: RepackResult, on_bytes: Progress) -> None:
        from trellis_cli.dialects.routepack.manifest import file_entry

        ck, output = self.ck, self.output
        for shard in output.shards:
            sources = self.hashes.of({f for li in output.shards[shard] for f in ck.layers[li].files}
                                     | ({shard} & set(ck.files)))
            if stage.completed(shard, sources):
                result.files_resumed += 1
                continue
            path = output.write_shard(stage, shard, on_bytes)
            stage.record(shard, file_entry(path), sources)
            result.files_written += 1
            result.bytes_written += path.stat().st_size

        def copy(name: str, target: Path) -> None:
            shutil.copyfile(ck.source.local_path(name), target)
            self.hashes.check_copy(name, target)

        output.write_rest(stage, copy)

    def verify(self, tree: Path) -> None:
        _format_check(tree, self.validator)


def _format_check(tree: Path, validator: Validator) -> None:
    """The staged stream must pass its format rules; loader refusals it shares with its source (the R7
    version's exact architecture gate refuses every stream but GLM-5.3-Flash's own) are the source's verdicts."""
    from trellis_cli.dialects import open_checkpoint

    report = validator(open_checkpoint(tree))
    errors = [f.line() for f in report.errors if not f.code.startswith("engine.")]
    if errors:
        raise CheckFailed(f"{tree}: the staged GLM-5.3 stream does not validate: {errors[0]}")
