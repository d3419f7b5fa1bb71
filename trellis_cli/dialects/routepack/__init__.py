"""trellis's own route pack (manifest.json, schema "trellis-route-pack"): what `trellis repack` writes.

Each layer file holds one LayerPack (formats/layer_pack.py, the kernel's layout, which every packer makes). This
package owns everything else about the format: its names on disk (`layout.py`), one layer file written and read
(`layer_file.py`), manifest.json written and read (`manifest.py`) and its shape (`manifest_shape.py`), reading a
route-pack directory as a checkpoint (detection, the verification against its manifest in `verify.py`: every hash,
every name, bounded by what the directory holds), its verdicts (no profiled loader reads it; `repack --to tr3`
rebuilds the served layout), its layer files read as stored for bench (`holds_layer_packs`, `read_layer_pack`), and,
as a conversion target, its plan (`plan.py`, `preflight.py`), its writer (`write.py`), the read-back of each
written layer file against its source (`readback.py`) and the TR3 driver (`tr3_to_route_pack.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from trellis_cli.checkpoint.model import DIALECT_EXL3V1, DIALECT_ROUTE_PACK, DIALECT_TR3_PER_EXPERT, DIALECT_TR3_SHARED_H
from trellis_cli.dialects.routepack.declared import detect_route_pack, manifest_of
from trellis_cli.dialects.routepack.layout import MANIFEST_NAME, layer_file_name
from trellis_cli.formats.layer_pack import LayerPack
from trellis_cli.dialects.interface import (CONFIG, QUANT_CONFIG, VLLM, CheckRequest, Dialect, DialectInfo, Probe,
                                           read_json_or_none)

if TYPE_CHECKING:
    from trellis_cli.dialects.units import Key, Unit
    from trellis_cli.dialects.routepack.inspect import RoutePackDocument

MANIFEST_ROTATIONS = {"per_expert": "per_expert_v1", "shared_h": "shared_h_v1"}  # the manifest's word -> the model's

# What a route pack is for, said wherever one is made or read (repack --help, validate, inspect).
PURPOSE = ("a route pack is the bundled fused kernel's own layout, for `trellis bench` and kernel work: no serving "
           "engine loads it. To serve, convert the source instead: `trellis repack SRC OUT --to tr3 --tp N` for "
           "the vLLM fork, `trellis repack SRC OUT --to exl3-v1` for b12x (a route pack converts back with --to tr3)")

NOTE = ("tensor values not checked: the sha256 of every file matches the manifest repack wrote "
        "(validate the source with --deep to check its data)")


class RoutePackDialect(Dialect):
    name = DIALECT_ROUTE_PACK
    target = "route-pack"
    described_as = "a trellis route pack"
    writer = "trellis_cli.dialects.routepack.write"
    tensor_data = False  # every file's sha256 is compared with the manifest instead (NOTE)
    records_hashes = True
    opens_from_listing = True  # manifest.json decides; the verifier owns config.json (a hashed file of the pack)
    container_notes = {VLLM: "a route pack is trellis' own layout (repack --to tr3 rebuilds the served one)"}
    converts_from = {DIALECT_TR3_PER_EXPERT: "tr3-to-route-pack", DIALECT_TR3_SHARED_H: "tr3-to-route-pack",
                     DIALECT_EXL3V1: "exl3-v1-to-route-pack"}
    drivers = {"tr3-to-route-pack": "trellis_cli.dialects.routepack.tr3_to_route_pack:Tr3ToRoutePack",
               "exl3-v1-to-route-pack": "trellis_cli.dialects.exl3v1.exl3v1_to_route_pack:Exl3v1ToRoutePack"}

    def detect(self, probe: Probe) -> DialectInfo | None:
        return detect_route_pack(probe)

    def holds_layer_packs(self, directory: Path) -> bool:
        from trellis_cli.dialects.routepack.manifest import is_route_pack

        return is_route_pack(directory)

    def stored_layer_packs(self, directory: Path) -> list[int]:
        from trellis_cli.dialects.routepack.manifest import declared_layers, read_manifest
        from trellis_cli.errors import CheckFailed, SourceUnavailable

        try:  # the guarded reader: size, depth and Unicode limits, as for every checkpoint JSON
            doc, _ = read_manifest(directory)
        except CheckFailed as err:
            raise SourceUnavailable(f"{directory}/{MANIFEST_NAME}: cannot read its layer list ({err})") from None
        return declared_layers(doc)

    def layer_pack_tp(self, directory: Path) -> Any:
        from trellis_cli.sources import read_json_file

        doc = read_json_file(directory / MANIFEST_NAME, MANIFEST_NAME)
        return doc.get("tp") if isinstance(doc, dict) else None

    def layer_pack_path(self, directory: Path, layer: int, rank: int) -> Path:
        return directory / layer_file_name(layer, rank)

    def read_layer_pack(self, directory: Path, layer: int, rank: int, device: str = "cpu") -> LayerPack:
        from trellis_cli.dialects.routepack.layer_file import read_layer_pack

        return read_layer_pack(directory, layer, rank, device=device)

    def compared_layers(self, ckpt) -> list[int]:
        from trellis_cli.dialects.routepack.units import manifest_layers

        return manifest_layers(ckpt)

    def layer_units(self, ckpt, layer: int, tp: int) -> dict[Key, Unit]:
        from trellis_cli.dialects.routepack.units import layer_units

        return layer_units(ckpt, layer, tp)

    def other_units(self, ckpt) -> dict[Key, Unit]:
        from trellis_cli.dialects.routepack.units import other_units

        return other_units(ckpt)

    def loose_tensors(self, ckpt) -> list:
        from trellis_cli.dialects.routepack.units import loose_tensors

        return loose_tensors(ckpt)

    def layer_files(self, ckpt) -> dict[str, int]:
        from trellis_cli.dialects.routepack.inspect import layer_files

        return layer_files(ckpt)

    def model_facts(self, ckpt) -> dict[str, Any]:
        """Its geometry and rotation layout from the manifest (the model leaves them to the verifier)."""
        manifest = manifest_of(ckpt)
        if manifest is None:
            return {}
        geometry: Any = manifest.get("geometry") if isinstance(manifest.get("geometry"), dict) else {}
        return dict(hidden=geometry.get("hidden"), intermediate=geometry.get("intermediate"),
                    num_experts=geometry.get("num_experts"),
                    rotation_layout=MANIFEST_ROTATIONS.get(str(manifest.get("rotation")), ckpt.rotation_layout))

    def declaration_documents(self, ckpt) -> dict[str, Any]:
        """config.json (carried beside the layer files when the model did not read it) and manifest.json."""
        docs: dict[str, Any] = {}
        config = ckpt.config or read_json_or_none(ckpt, CONFIG)
        if config:
            docs[CONFIG] = config
        if ckpt.quant_config:
            docs[QUANT_CONFIG] = ckpt.quant_config
        manifest = manifest_of(ckpt)
        if manifest is not None:
            docs["manifest.json"] = manifest
        return docs

    def weights_refusal(self, ckpt) -> str | None:
        return ("a route pack is the kernel's layout of one checkpoint's experts only: run fit on the checkpoint it "
                "was made from")

    def inspect_document(self, ckpt, layers: list[int] | None) -> RoutePackDocument:
        from trellis_cli.dialects.routepack.inspect import route_pack_document

        return route_pack_document(ckpt, layers, PURPOSE)

    def declared_layers(self, ckpt) -> list[int]:
        from trellis_cli.dialects.routepack.manifest import declared_layers

        return declared_layers(manifest_of(ckpt))

    def names_reported(self, ckpt) -> set[str]:
        """Every file its manifest lists: the verification against the manifest checks each (verify.py)."""
        manifest = manifest_of(ckpt)
        files = manifest.get("files") if manifest is not None else None
        return {name for name in files if isinstance(name, str)} if isinstance(files, dict) else set()

    def hashes_by_default(self, ckpt) -> bool:
        """Its manifest's hashes are compared on every run, by `check` (the verifier repack runs too)."""
        return True

    def check(self, ckpt, request: CheckRequest, report) -> None:
        """Every file against the manifest repack wrote, hashes included: always, --checksums or not (one read
        of the directory; hashing is the only check that sees a flipped byte inside tensor data). The hashes
        go through the one comparison of recorded hashes (integrity.check_recorded)."""
        from trellis_cli.dialects.routepack.verify import verify_route_pack

        found = verify_route_pack(ckpt.source, check_hashes=True, progress=request.checksum_progress)
        report.findings.extend(found.findings)
        report.checked.update(found.checked)
        report.omitted.update(found.omitted)
        report.notes.extend(found.notes)
        report.notes.append(PURPOSE)
        for key, value in found.context.items():
            report.context.setdefault(key, value)
        report.notes.append(NOTE)
        if request.narrowed:
            report.notes.append("--layers does not narrow a route pack's checks: every file is checked against "
                                "its manifest")


DIALECT = RoutePackDialect()
