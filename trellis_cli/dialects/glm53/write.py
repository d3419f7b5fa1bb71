"""The GLM-5.3 unsliced stream as a conversion's two ends: the TR3 form it takes (`repack STREAM --to tr3`) and
the stream written back from TR3 rank slices (`repack TR3 --to glm53-stream`).

To TR3: the stream's config.json gains `hybrid_tr3_tail` (uniform K, per_expert_v1, the TR3 schema, the chosen
tp), top-level copies of the text model's geometry (TR3 readers take them from there), its quantization block
loses `scope` (with it, the fork's loader would stream the checkpoint as unsliced and ignore the rank slices),
and a note (`glm53_stream_source`) keeps the source's config.json and quantization_config.json texts, so the way
back restores them byte for byte.

Back: each TR3 shard that holds MoE layers becomes the stream shard of the same name: its carried tensors
unchanged, and per (layer, expert, projection) the full-width linear joined from the rank slices: gate/up
trellis along the output tiles (dim 1) and svh along its length, down trellis along the input tiles (dim 0) and
suh; the hidden-side vector (gate/up suh, down svh) and the marker must be byte-identical on every rank (refused
otherwise: only re-quantization could merge them). A pure rearrangement of 16-channel tiles: exact or refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from trellis_cli.checkpoint.model import Checkpoint, TensorRef
from trellis_cli.dialects.glm53.contract import (DTYPES, FIELDS, PROJECTIONS, SCOPE, expert_key, linear_shapes,
                                                text_config)
from trellis_cli.dialects.interface import StagedOutput
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.header import is_int, plain_relative, read_local_header
from trellis_cli.integrity import CHECKSUM_MANIFEST
from trellis_cli.dialects import carry
from trellis_cli.checkpoint.tensor_bytes import TensorReader
from trellis_cli.stwriter import PlannedTensor, SafetensorsWriter

NOTE_KEY = "glm53_stream_source"
CONFIG, QUANT_CONFIG, INDEX = "config.json", "quantization_config.json", "model.safetensors.index.json"
TR3_SCHEMA = "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
GEOMETRY_KEYS = ("hidden_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                 "num_hidden_layers", "num_nextn_predict_layers", "first_k_dense_replace")
# The rank axis of each field when rank slices are joined: None = the same on every rank.
JOIN_DIM = {("gate_proj", "trellis"): 1, ("up_proj", "trellis"): 1, ("down_proj", "trellis"): 0,
            ("gate_proj", "svh"): 0, ("up_proj", "svh"): 0, ("down_proj", "suh"): 0,
            ("gate_proj", "suh"): None, ("up_proj", "suh"): None, ("down_proj", "svh"): None}


def routed_placement(ck: Checkpoint, layers: list[int]) -> dict[str, Any]:
    """Which stream file holds each (layer, expert, projection): per file, ascending runs [start, stop) of
    ((layer - first) * experts + expert) * 3 + projection. A release spreads a layer over several files; with this
    the way back writes each file with exactly its own tensors again."""
    first, experts = layers[0], ck.num_experts or 0
    per_file: dict[str, list[int]] = {}
    for li in layers:
        for e, projs in ck.layers[li].experts.items():
            for p, proj in enumerate(PROJECTIONS):
                lin = projs[proj][0]
                files = {ref.file for ref in (lin.trellis, lin.suh, lin.svh, lin.mcg) if ref is not None}
                if len(files) != 1:
                    raise UsageError(f"--to tr3: layer {li} expert {e} {proj}: its fields lie in {sorted(files)}; "
                                     "a linear in one file is what the way back can restore")
                per_file.setdefault(files.pop(), []).append(((li - first) * experts + e) * 3 + p)
    return {"first_layer": first, "experts": experts,
            "files": {f: _runs(sorted(ix)) for f, ix in sorted(per_file.items())}}


def _runs(ids: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def tr3_config(config_text: str, quant_text: str | None, layers: list[int], tp: int, k: int,
               placement: dict[str, Any]) -> dict[str, Any]:
    """config.json of the TR3 form (see the module docstring); `*_text` are the source files' exact texts."""
    config = json.loads(config_text)
    text = text_config(config)
    block = dict(config.get("quantization_config") or {})
    block.pop("scope", None)
    tr3 = {key: text[key] for key in GEOMETRY_KEYS if key in text and key not in config}
    tr3.update({k_: v for k_, v in config.items() if k_ != "quantization_config"})
    tr3["quantization_config"] = block
    tr3["hybrid_tr3_tail"] = {
        "format": "exl3-trellis", "bits": k, "trellis_bits_by_layer": {str(li): k for li in layers},
        "codebook": "mcg", "experts_per_layer": text.get("n_routed_experts"), "moe_layers": [layers[0], layers[-1]],
        "tensor_schema": TR3_SCHEMA, "tp": tp, "rotation_layout": "per_expert_v1",
        "producer_version": "trellis repack (from a GLM-5.3 unsliced stream)"}
    tr3[NOTE_KEY] = {"scope": SCOPE, "config_json": config_text, "quantization_config_json": quant_text,
                     "routed": placement}
    return tr3


def note_of(ck: Checkpoint) -> dict[str, Any]:
    """The note a TR3 made from a stream carries; refused by name when absent or damaged."""
    note = ck.config.get(NOTE_KEY)
    if not isinstance(note, dict) or note.get("scope") != SCOPE or not isinstance(note.get("config_json"), str):
        raise UsageError(f"--to glm53-stream: config.json has no {NOTE_KEY} note (scope {SCOPE} and the stream's "
                         "own config.json): only a TR3 made from a GLM-5.3 stream (`repack STREAM --to tr3`) "
                         "converts back; its release config cannot be guessed")
    if note.get("quantization_config_json") is not None and not isinstance(note["quantization_config_json"], str):
        raise UsageError(f"--to glm53-stream: {NOTE_KEY}.quantization_config_json is not a text")
    routed = note.get("routed")
    ok = isinstance(routed, dict) and is_int(routed.get("first_layer")) and is_int(routed.get("experts")) and \
        isinstance(routed.get("files"), dict) and all(
            plain_relative(f) and str(f).endswith(".safetensors") and isinstance(runs, list) and all(
                isinstance(r, list) and len(r) == 2 and all(is_int(v) and v >= 0 for v in r) and r[0] < r[1]
                for r in runs) for f, runs in routed["files"].items())
    if not ok:
        raise UsageError(f"--to glm53-stream: {NOTE_KEY}.routed (which stream file held which experts) is missing "
                         "or malformed: the stream's files cannot be restored")
    return note


class StreamOutput:
    """What `repack TR3 --to glm53-stream` writes: one stream shard per TR3 shard, the restored JSON files."""

    def __init__(self, tr3: Checkpoint, layers: list[int], note: dict[str, Any]) -> None:
        self.ck, self.layers, self.note = tr3, layers, note
        self.k = {li: self._uniform_k(li) for li in layers}
        routed = note["routed"]
        first, experts = routed["first_layer"], routed["experts"]
        # stream file -> its (layer, expert, projection), in the note's order
        self.members: dict[str, list[tuple[int, int, str]]] = {}
        for f, runs in routed["files"].items():
            ids = [i for start, stop in runs for i in range(start, stop)]
            self.members[f] = [(first + i // 3 // experts, i // 3 % experts, PROJECTIONS[i % 3]) for i in ids]
            for li, e, proj in self.members[f]:
                if li not in self.k or proj not in tr3.layers[li].experts.get(e, {}):
                    raise CheckFailed(f"{NOTE_KEY}.routed places layer {li} expert {e} {proj} in {f}; the TR3 "
                                      "checkpoint has no such linear")
        self.shards = {f: sorted({li for li, _, _ in m}) for f, m in self.members.items()}
        self.carried = {f: carry.refs_of(tr3.headers[f], [n for n in tr3.headers[f].tensors
                                                          if ".mlp.experts." not in n])
                        for f in self.shards if f in tr3.headers}
        written_anew = {CONFIG, INDEX, QUANT_CONFIG, CHECKSUM_MANIFEST}
        self.copied = [f for f in sorted(tr3.files) if f not in self.shards and f not in written_anew
                       and not any(f in moe.files for moe in tr3.layers.values())]

    def _uniform_k(self, li: int) -> int:
        ks = {lin.k for projs in self.ck.layers[li].experts.values() for by_rank in projs.values()
              for lin in by_rank.values()}
        k = next(iter(ks)) if len(ks) == 1 else None
        if k is None:
            raise UsageError(f"--to glm53-stream: layer {li} holds K {sorted(ks, key=str)}; the stream declares one "
                             "K (bits) for every expert")
        return k

    def metadata(self, shard: str) -> dict[str, str] | None:
        """The stream file's own __metadata__: the TR3 shard of its name kept it (safetensors' default else)."""
        header = self.ck.headers.get(shard)
        return header.metadata if header is not None else {"format": "pt"}

    def claims(self) -> list[tuple[str, str]]:
        return [(CONFIG, "the stream's config.json"), (QUANT_CONFIG, "the stream's quantization_config.json"),
                (INDEX, "the stream's index")] + [(s, f"the stream shard of layers {ls}") for s, ls in
                                                  self.shards.items()] + [(f, f"source file {f}") for f in self.copied]

    def plan(self, shard: str) -> list[PlannedTensor]:
        ck = self.ck
        assert ck.hidden is not None and ck.intermediate is not None  # a TR3 source's geometry, declared or read from its tensors
        out = [PlannedTensor(r.name, r.dtype, r.shape) for r in self.carried.get(shard, [])]
        for li, expert, proj in self.members[shard]:
            shapes = linear_shapes(ck.hidden, ck.intermediate, proj, self.k[li])
            out += [PlannedTensor(expert_key(li, expert, proj, f), DTYPES[f], shapes[f]) for f in FIELDS]
        return out

    def output_bytes(self) -> int:
        return sum(carry.file_bytes(self.plan(s), self.metadata(s)) for s in self.shards) + \
            sum(self.ck.files.get(f, 0) for f in self.copied)

    def write_shard(self, staged: StagedOutput, shard: str, on_bytes: Callable[[int], None]) -> Path:
        path = staged.file(shard, f"the stream shard of layers {self.shards[shard]}")
        plan = self.plan(shard)
        with TensorReader(self.ck.source) as reader, SafetensorsWriter(path, plan, self.metadata(shard)) as writer:
            carry.copy_into(writer, reader, self.carried.get(shard, []), on_bytes)
            for li, expert, proj in self.members[shard]:
                for field, data in self.joined(li, expert, proj).items():
                    writer.write(expert_key(li, expert, proj, field), data)
                    on_bytes(data.numel() * data.element_size())
        self.check_shard(path, shard)
        return path

    def joined(self, li: int, expert: int, proj: str) -> dict[str, Any]:
        """The full-width linear from every rank's slice (refused when a replicated field differs by rank)."""
        import torch

        from trellis_cli.checkpoint.tensors import read_tensor

        by_rank = self.ck.layers[li].experts[expert][proj]
        ranks = [by_rank.get(r) for r in range(self.ck.tp)]
        if any(lin is None for lin in ranks):
            raise CheckFailed(f"layer {li} expert {expert} {proj}: a rank slice is missing")
        out = {}
        for field in FIELDS:
            refs = [getattr(lin, field) for lin in ranks]
            if any(ref is None for ref in refs):
                raise CheckFailed(f"layer {li} expert {expert} {proj}: .{field} missing on a rank")
            parts = [read_tensor(self.ck, ref) for ref in refs]
            dim = JOIN_DIM.get((proj, field))
            if dim is None:
                for rank, part in enumerate(parts[1:], 1):
                    if part.shape != parts[0].shape or not torch.equal(part.view(-1).view(torch.uint8),
                                                                       parts[0].view(-1).view(torch.uint8)):
                        raise CheckFailed(
                            f"[glm53.h-side-differs] layer {li} expert {expert} {proj} .{field}: rank {rank} differs "
                            "from rank 0; the stream holds one full-width linear, and each rank's codes were chosen "
                            "under its own vector, so only re-quantization could merge them (refused)")
                out[field] = parts[0].reshape(()) if field == "mcg" else parts[0]
            else:
                out[field] = torch.cat(parts, dim=dim).contiguous()
        return out

    def check_shard(self, path: Path, shard: str) -> None:
        """Read the written shard back: carried tensors byte-equal to the source, every routed tensor equal to
        the joined slices it was written from."""
        import torch

        from trellis_cli.checkpoint.tensors import read_tensor
        from trellis_cli.sources import LocalSource

        header = read_local_header(path, path.name)
        written = Checkpoint(source=LocalSource(path.parent), dialect="", config={}, hidden=None, intermediate=None,
                             num_experts=None, tp=1, codebook=None, rotation_layout="n/a")

        def ref(name: str) -> TensorRef:
            e = header.tensors[name]
            return TensorRef(name, path.name, e.dtype, e.shape, e.begin, e.end, header.data_start)

        for src in self.carried.get(shard, []):
            if not torch.equal(read_tensor(written, ref(src.name)).view(-1).view(torch.uint8),
                               read_tensor(self.ck, src).view(-1).view(torch.uint8)):
                raise CheckFailed(f"{shard}: {src.name} read back differs from the TR3 source")
        for li, expert, proj in self.members[shard]:
            for field, data in self.joined(li, expert, proj).items():
                got = read_tensor(written, ref(expert_key(li, expert, proj, field)))
                if got.shape != data.shape or not torch.equal(got.reshape(-1).view(torch.uint8),
                                                              data.reshape(-1).view(torch.uint8)):
                    raise CheckFailed(f"{shard}: {expert_key(li, expert, proj, field)} read back differs")

    def write_rest(self, staged: StagedOutput, copy: Callable[[str, Path], None]) -> None:
        """Copied shards, the restored config.json / quantization_config.json, and the index."""
        weight_map: dict[str, str] = {}
        for name in self.copied:
            target = staged.file(name, f"source file {name}")
            copy(name, target)
        tree = staged.path
        for name in [*self.shards, *self.copied]:
            weight_map.update(dict.fromkeys(read_local_header(tree / name, name).tensors, name))
        staged.file(CONFIG, "the stream's config.json").write_text(self.note["config_json"], encoding="utf-8")
        if self.note.get("quantization_config_json") is not None:
            staged.file(QUANT_CONFIG, "the stream's quantization_config.json").write_text(
                self.note["quantization_config_json"], encoding="utf-8")
        total = sum(e.nbytes for f in set(weight_map.values()) for e in read_local_header(tree / f, f).tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        staged.file(INDEX, "the stream's index").write_text(json.dumps(index, separators=(",", ":")),
                                                            encoding="utf-8")
