"""b12x's `exl3-v1` MoE container: exl3-manifest.json plus one slot-major safetensors file per layer.

Everything trellis knows about it lives here: `container` (the container in the normalized model), `rules`
(every check of b12x's reader, and what it leaves unchecked), `inspect` (its inspect rows), `pack` (a rank's
slot extent as a route-pack LayerPack, and back), `write` (layer files and manifest), `synth` (synthetic
exl3-v1 checkpoints), `schema` and `layout` (the manifest, parsed strictly, and the byte arithmetic of rows,
bundles, planes and TP extents: torch-free), `from_tr3` (TR3 ranks -> one exl3-v1 layer file, read back) and
`pack_readback` (a route-pack layer file made from it, read back against its rows). The repack drivers around
them are repack's (dialects/exl3v1/tr3_to_exl3v1.py, exl3v1_to_tr3.py, exl3v1_to_route_pack.py, exl3v1_btx.py).
docs/checkpoint-dialects.md describes the container.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from trellis_cli.checkpoint.model import (DIALECT_EXL3V1, DIALECT_TR3_PER_EXPERT, DIALECT_TR3_SHARED_H, PROJECTIONS,
                                         VectorRef)
from trellis_cli.findings import Location
from trellis_cli.integrity import RecordedHash
from trellis_cli.dialects.exl3v1.container import Exl3v1Declarations, declarations
from trellis_cli.dialects.exl3v1.declared import detect_exl3v1
from trellis_cli.dialects.interface import (B12X, VLLM, VLLM_MANIFEST, CheckRequest, Dialect, DialectInfo, LayerShare,
                                           Probe, read_json_or_none)

if TYPE_CHECKING:
    from trellis_cli.dialects.units import Key, Unit
    from trellis_cli.dialects.exl3v1.inspect import Exl3v1Document


class Exl3v1Dialect(Dialect):
    name = DIALECT_EXL3V1
    target = "exl3-v1"
    described_as = "an exl3-v1"
    default_engine = "b12x-exl3-v1"
    records_hashes = True  # the manifest's sha256 per layer file
    publisher_digests = True  # a Hub file's LFS sha256 is the layer file's digest too
    read_by = frozenset({B12X, VLLM_MANIFEST})
    container_notes = {VLLM: "exl3-v1 is b12x's container"}
    writer = "trellis_cli.dialects.exl3v1.write"
    synth = "trellis_cli.dialects.exl3v1.synth"
    converts_from = {DIALECT_TR3_PER_EXPERT: "tr3-to-exl3-v1", DIALECT_TR3_SHARED_H: "tr3-to-exl3-v1",
                     "btx-atoms-v1": "btx-to-exl3-v1"}  # BTX: a renaming (dialects/btx/)
    drivers = {"tr3-to-exl3-v1": "trellis_cli.dialects.exl3v1.tr3_to_exl3v1:Tr3ToExl3v1",
               "btx-to-exl3-v1": "trellis_cli.dialects.btx.exl3v1_btx:btx_to_exl3v1"}

    def detect(self, probe: Probe) -> DialectInfo | None:
        return detect_exl3v1(probe)

    def fill(self, ckpt, probe: Probe, info: DialectInfo) -> bool:
        from trellis_cli.dialects.exl3v1.container import fill_checkpoint

        assert isinstance(info.declared, Exl3v1Declarations) and info.declared.manifest_file is not None
        fill_checkpoint(ckpt, ckpt.source, probe.files, info.declared.manifest_file, info.declared)
        return True

    def check(self, ckpt, request: CheckRequest, report) -> None:
        from trellis_cli.dialects.exl3v1.rules import check_exl3v1

        check_exl3v1(ckpt, report, request.layers, deep=request.deep, progress=request.progress)

    def recorded_hashes(self, ckpt, request: CheckRequest) -> list[RecordedHash]:
        """The manifest's sha256 of each chosen layer file that could be read (the others are findings)."""
        from trellis_cli.dialects.exl3v1.container import container, finding_where

        box = container(ckpt)
        if box.manifest is None:
            return []
        chosen = [box.layers[i] for i in request.layers if box.layers[i].readable]
        return [RecordedHash(layer.file, layer.sha256, finding_where(layer), "exl3v1.sha256-mismatch",
                             "the layer file's sha256 differs from the manifest") for layer in chosen]

    def slot_manifest(self, ckpt) -> tuple[Any, str] | None:
        from trellis_cli.dialects.exl3v1.container import container

        box = container(ckpt)
        return (box.manifest, box.manifest_file) if box.manifest is not None else None

    # ---- its bytes, as diff, fit and inspect ask about them -------------------------------------------------

    def stored_tp(self, ckpt) -> int | None:
        return None  # a rank is a slot extent, cut at whatever TP the layout allows

    def read_tp(self, ckpt) -> int:
        from trellis_cli.dialects.exl3v1.units import read_tp

        return read_tp(ckpt)

    def layer_units(self, ckpt, layer: int, tp: int) -> dict[Key, Unit]:
        from trellis_cli.dialects.exl3v1.units import layer_units

        return layer_units(ckpt, layer, tp)

    def other_units(self, ckpt) -> dict[Key, Unit]:
        from trellis_cli.dialects.exl3v1.units import other_units

        return other_units(ckpt)

    def layer_file_tensors(self, ckpt, layer: int) -> dict[Key, Unit]:
        from trellis_cli.dialects.exl3v1.units import layer_file_tensors

        return layer_file_tensors(ckpt, layer)

    def stored_expert_k(self, ckpt, layer: int) -> dict[int, int | None] | None:
        from trellis_cli.dialects.exl3v1.units import rate_expert_k

        return rate_expert_k(ckpt, layer)

    def model_facts(self, ckpt) -> dict[str, Any]:
        return {"tp": None}  # a rank is a slot extent: no stored TP

    def declaration_documents(self, ckpt) -> dict[str, Any]:
        """config.json and the quantization config, and its manifest (read again: the model keeps it parsed)."""
        docs = super().declaration_documents(ckpt)
        declared = declarations(ckpt)
        name = declared.manifest_file if declared is not None else None
        if name is not None:
            manifest = read_json_or_none(ckpt, name)
            if manifest is not None:
                docs[name] = manifest
        return docs

    def layer_files(self, ckpt) -> dict[str, int]:
        from trellis_cli.dialects.exl3v1.units import layer_files

        return layer_files(ckpt)

    def loose_tensors(self, ckpt) -> list:
        from trellis_cli.dialects.exl3v1.units import loose_tensors

        return loose_tensors(ckpt)

    def codes_tables(self, ckpt) -> dict[str, tuple[int, int]]:
        from trellis_cli.dialects.exl3v1.inspect import codes_tables

        return codes_tables(ckpt)

    def layer_shares(self, ckpt, tp: int, rates_below: int) -> list[LayerShare]:
        from trellis_cli.dialects.exl3v1.weights import layer_shares

        return layer_shares(ckpt, tp, rates_below)

    def source_digests(self, ckpt) -> dict[str, list[tuple[str, str, str]]]:
        """The manifest's sha256 of each layer file (the all-zero digest of a sparse synthetic checkpoint
        records nothing)."""
        from trellis_cli.dialects.exl3v1.container import container

        box = container(ckpt)
        out: dict[str, list[tuple[str, str, str]]] = {}
        for index, layer in box.layers.items():
            if layer.sha256 and set(layer.sha256) != {"0"}:
                out.setdefault(layer.file, []).append(
                    (layer.sha256, f"the manifest's layers.{index}.sha256 in {box.manifest_file}",
                     "exl3v1.sha256-mismatch"))
        return out

    def inspect_document(self, ckpt, layers: list[int] | None) -> Exl3v1Document:
        from trellis_cli.dialects.exl3v1.inspect import exl3v1_document

        return exl3v1_document(ckpt, layers)

    def vectors(self, ckpt, layer: int) -> Iterator[VectorRef]:
        """The hidden-side tables: one row per expert ([E, hidden]), or one vector for all of them ([hidden])."""
        from trellis_cli.dialects.exl3v1.container import HIDDEN_TABLES, container
        from trellis_cli.dialects.exl3v1.rules import expected_shapes

        box = container(ckpt)
        entry = box.layers.get(layer)
        if box.manifest is None or entry is None or not entry.readable:
            return
        shapes = expected_shapes(box.manifest)
        for table, proj in zip(HIDDEN_TABLES, PROJECTIONS):
            ref = entry.ref(table)
            if ref is None or ref.dtype != "F16" or tuple(ref.shape) != shapes[table]:
                continue  # the layer's header findings say what is wrong with it
            kind = "svh" if table.endswith("svh") else "suh"
            if len(ref.shape) == 1:
                yield VectorRef(Location(ref.file, layer, None, proj, None, table), kind, ref)
                continue
            for expert in range(ref.shape[0]):
                yield VectorRef(Location(ref.file, layer, expert, proj, None, f"{table}[{expert}]"), kind, ref, expert)

    def names_reported(self, ckpt) -> set[str]:
        """The layer files its manifest names, checked while opening (container.py)."""
        from trellis_cli.dialects.exl3v1.container import container

        return {layer.file for layer in container(ckpt).layers.values()}

    def hashes_by_default(self, ckpt) -> bool:
        """The manifest records each layer file's sha256: compared whenever the bytes are local, as a route
        pack's are (a digest of all zeros, recorded for no data as a sparse synth writes, only with --checksums)."""
        return ckpt.source.root is not None

    def rank_tp_degrees(self, ckpt) -> list[int] | None:
        from trellis_cli.dialects.exl3v1.container import container
        from trellis_cli.dialects.exl3v1.layout import tp_degrees

        m = container(ckpt).manifest
        assert m is not None  # an opened container that parsed (bench asks only of one)
        return list(tp_degrees(m))

    def tp_partitions(self, ckpt, tp: int):
        """b12x's partition_extents and the fork's plan_exl3_extent at `tp` (partitions.py)."""
        from trellis_cli.dialects.exl3v1.container import container
        from trellis_cli.dialects.exl3v1.partitions import tp_partitions

        m = container(ckpt).manifest
        return None if m is None else tp_partitions(m, tp)

    def layer_pack(self, ckpt, layer, rank, tp=None, device="cpu"):
        from trellis_cli.dialects.exl3v1.pack import default_tp, exl3v1_pack
        from trellis_cli.dialects.shard_pack import to_device

        return to_device(exl3v1_pack(ckpt, layer, rank, default_tp(ckpt) if tp is None else tp), device)


DIALECT = Exl3v1Dialect()
