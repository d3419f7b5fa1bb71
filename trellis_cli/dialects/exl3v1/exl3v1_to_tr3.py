"""exl3-v1 as a source: `trellis repack EXL3 OUT --to tr3 [--tp N]`, and one (layer, rank) for `trellis bench`.

Each TR3 shard is written by the TR3 dialect's writer (dialects/tr3/write.py, shard.py) from one LayerPack per
rank, read from the rank's slot extent (pack.py), and read back against those packs. Any `--tp` the slot layout
allows works (default: the TP recorded when the checkpoint was converted from TR3, else the largest allowed degree up to
4); hidden-side tables are replicated per rank. `tr3_form` says what else the TR3 form holds (config.json,
tier_bitmap.json, carried files, shard names); exl3v1_to_route_pack.py records the same in a route pack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.names import shard_name
from trellis_cli.errors import UsageError
from trellis_cli.dialects.exl3v1.container import container, parsed_manifest
from trellis_cli.dialects.exl3v1.pack import (NOTE_KEY, check_convertible, checked_rates, conversion_note,
                                              default_tp, expert_tiers, exl3v1_pack)
from trellis_cli.selection import parse_selection
from trellis_cli.dialects.conversion import Validator, check_output
from trellis_cli.dialects.source_facts import SourceHashes, protected_paths
from trellis_cli.dialects.tr3.shard import Tr3Layer
from trellis_cli.dialects.tr3.write import Tr3Output, assign_shards, restored_config
from trellis_cli.dialects.tr3.driver import Tr3Driver, fingerprint_options

@dataclass
class Tr3Form:
    """What the TR3 form of selected exl3-v1 layers holds besides the shards (also what a route pack of them
    carries, so that `repack PACK --to tr3` writes the same checkpoint as `repack EXL3 --to tr3`)."""

    config: dict[str, Any]
    extra_json: dict[str, Any]  # name -> JSON document written next to config.json (tier_bitmap.json)
    copy_from: dict[str, Path]  # name -> local file carried byte for byte
    shard_names: dict[int, str]
    vector_ndim: dict[str, int]


def tr3_form(ck: Checkpoint, layers: list[int], tiers, tp: int, copy_other: bool) -> Tr3Form:
    """config.json: the carried one when the checkpoint came from TR3 (its note restores shard names and vector
    shapes), else one written from the manifest, with tier_bitmap.json for mixed K."""
    from trellis_cli.dialects.exl3v1.carry import carried_files

    m = parsed_manifest(ck)
    note = conversion_note(ck)
    shared = not m.per_expert_input_rotations
    names = note.get("shard_names", {})
    copy_from = carried_files(ck, copy_other, frozenset({container(ck).manifest_file}))
    if isinstance(ck.config.get("hybrid_tr3_tail"), dict):
        config = restored_config({k: v for k, v in ck.config.items() if k != NOTE_KEY}, tp, shared)
        extra: dict[str, Any] = {}
    else:
        config, extra = _tr3_config(m, tiers, tp, shared)
        copy_from.pop("tier_bitmap.json", None)
    ndim = note.get("vector_ndim", {})
    return Tr3Form(config, extra, copy_from, {li: names.get(str(li), shard_name(li)) for li in layers},
                   {"per_expert": ndim.get("per_expert", 1), "shared_h": ndim.get("shared_h", 1)})


def exl3v1_to_tr3(ck: Checkpoint, out: Path, options, validator: Validator) -> Tr3Driver:
    """The `--to tr3` driver of an exl3-v1 source (the staged run validates the source before writing)."""
    if options.ranks is not None or options.shared_h:
        raise UsageError("--ranks and --shared-h do not apply when converting exl3-v1 to TR3")
    m = parsed_manifest(ck)
    tp = options.tp if options.tp is not None else default_tp(ck)
    check_convertible(m, tp)
    layers = parse_selection(options.layers, list(container(ck).layers), "layers")
    if layers != list(range(layers[0], layers[-1] + 1)):
        raise UsageError(f"--to tr3: layers {layers} are not contiguous; TR3 declares its MoE layers as one span")
    tiers = {li: expert_tiers(m, checked_rates(ck, li), li) for li in layers}
    form = tr3_form(ck, layers, tiers, tp, options.copy_other)
    shared = not m.per_expert_input_rotations
    specs = {li: Tr3Layer(li, {e: k for k, ids in tiers[li] for e in ids}, tp, m.hidden, m.intermediate // tp, "mcg",
                          shared, form.vector_ndim["per_expert"], form.vector_ndim["shared_h"]) for li in layers}
    box = container(ck)
    plan = Tr3Output(
        specs=specs, packs=lambda li, rank: exl3v1_pack(ck, li, rank, tp),
        shards=assign_shards({li: [form.shard_names[li]] for li in layers}),
        carried={}, carried_source=ck.source, metadata={}, copied=form.copy_from, config=form.config,
        read_copied=ck.source.read_json, source_root=protected_paths(ck),
        fingerprint={"source": ck.source.describe(), "options": fingerprint_options(options), "tp": tp},
        rewritten={name: json.dumps(doc, indent=2) + "\n" for name, doc in form.extra_json.items()})
    hashes = SourceHashes(ck)
    plan.check_copy = hashes.check_copy
    plan.final_check = lambda tree: check_output(tree, validator, "TR3")
    # A shard is made from its layers' exl3-v1 files, read as the manifest describes them.
    plan.sources = lambda shard: hashes.of({box.manifest_file, *(box.layers[li].file for li in plan.shards[shard])})
    return Tr3Driver(f"{ck.dialect} -> tr3", out, plan)


def _tr3_config(m, tiers, tp: int, shared: bool) -> tuple[dict, dict]:
    """config.json (and tier_bitmap.json when K is mixed) for a checkpoint that never was TR3."""
    from trellis_cli import synth

    layers = tuple(tiers)
    bitmap = {li: tuple(k for e in range(m.num_experts) for k, ids in tiers[li] if e in ids) for li in layers}
    ks = {k for per in bitmap.values() for k in per}
    choice = {"uniform_k": ks.pop()} if len(ks) == 1 else {"bitmap": bitmap}
    try:
        spec = synth.SynthSpec(hidden=m.hidden, intermediate=m.intermediate, experts=m.num_experts, tp=tp,
                               layers=layers, top_k=min(8, m.num_experts),
                               rotation_layout="shared_h_v1" if shared else "per_expert_v1", **choice)
    except UsageError as e:
        raise UsageError(f"--to tr3: this geometry has no TR3 form ({str(e).removeprefix('synth: ')})") from None
    config = synth.config_json(spec)
    config["hybrid_tr3_tail"]["producer_version"] = "trellis repack (from exl3-v1)"
    return config, ({"tier_bitmap.json": synth.tier_bitmap_json(spec)} if spec.mixed else {})
