"""The GLM-5.3 unsliced stream in the normalized model: headers read, routed experts parsed by the loader's own
schema (`model.language_model.layers.{L}.mlp.experts.{E}.{proj}.{field}`, no rank segment), one LinearRef per
(layer, expert, projection) at rank 0, `tp` 1 (the stored layout is unsliced; a server cuts it at load).

The shared shard reader reads `model.layers.` names only (and rightly calls these non-canonical for TR3), so
this dialect builds its own model, from headers read through the one reader. What cannot be read becomes a parse finding, never an exception.
"""

from __future__ import annotations

from typing import Any

from trellis_cli.checkpoint import reader
from trellis_cli.checkpoint.model import Checkpoint, LinearRef, MoeLayer, TensorRef
from trellis_cli.dialects.glm53.contract import EXPERT_NAME, FIELDS, RANK_NAME, UNDER_EXPERTS, text_config
from trellis_cli.findings import Location, error



def fill_checkpoint(ckpt: Checkpoint, files: dict[str, int]) -> None:
    """Headers, tensors, layers and geometry of a GLM-5.3 stream checkpoint into `ckpt`."""
    _read_headers(ckpt, files)
    _read_index(ckpt, files)
    _build_layers(ckpt)
    text = text_config(ckpt.config)
    ckpt.hidden = _positive(text.get("hidden_size"))
    ckpt.intermediate = _positive(text.get("moe_intermediate_size"))
    ckpt.num_experts = _positive(text.get("n_routed_experts"))
    ckpt.tp = 1
    ckpt.inferred = []


def _read_headers(ckpt: Checkpoint, files: dict[str, int]) -> None:
    """Every header through the one reader (its guards: escapes, dangling links, FIFOs, a file changed while read);
    the tensors of each, in file order, a name twice a finding."""
    ckpt.headers.update(reader.read_headers(ckpt.source, files, lambda _stage, _done, _total: None,
                                            ckpt.parse_findings))
    for file in sorted(ckpt.headers):
        header = ckpt.headers[file]
        for name, entry in header.tensors.items():
            if name in ckpt.tensors:
                ckpt.parse_findings.append(error("tensor.duplicate", Location(file=file, tensor=name),
                                                 f"also in {ckpt.tensors[name].file}: the first file's copy is used"))
                continue
            ckpt.tensors[name] = TensorRef(name, file, entry.dtype, entry.shape, entry.begin, entry.end,
                                           header.data_start)


def _read_index(ckpt: Checkpoint, files: dict[str, int]) -> None:
    found = reader.read_index(ckpt.source, files, ckpt.parse_findings)
    if found is None:
        return
    ckpt.index_file, weight_map, metadata = found
    ckpt.index = dict(weight_map)
    ckpt.index_metadata = metadata


def _build_layers(ckpt: Checkpoint) -> None:
    linears: dict[tuple[int, int, str], dict[str, TensorRef]] = {}
    for name, ref in ckpt.tensors.items():
        if ".mlp.experts." not in name:
            continue
        m = EXPERT_NAME.match(name)
        if m is not None:
            layer, expert, proj, field = int(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
            linears.setdefault((layer, expert, proj), {})[field] = ref
            continue
        under = UNDER_EXPERTS.match(name)
        if under is None:
            continue  # another prefix: not a routed expert of this layout (validate lists unknown tensors)
        layer_text = under.group(1)
        moe = ckpt.layers.setdefault(int(layer_text), MoeLayer(int(layer_text))) if layer_text.isdigit() else None
        if moe is not None:
            moe.unparsed.append(ref)
            moe.files.add(ref.file)
        else:
            ckpt.parse_findings.append(error("glm53.name", Location(file=ref.file, tensor=name),
                                             "reads as a routed-expert tensor but its layer id is not canonical "
                                             "decimal: the loader never builds this name",
                                             expected="model.language_model.layers.{L}.mlp.experts.{E}.{proj}.{field}"))
    for (layer, expert, proj), fields in sorted(linears.items()):
        moe = ckpt.layers.setdefault(layer, MoeLayer(layer))
        any_ref = next(iter(fields.values()))
        moe.files.add(any_ref.file)
        extra = tuple(ref for f, ref in fields.items() if f not in FIELDS and f != "mul1")
        moe.experts.setdefault(expert, {})[proj] = {0: LinearRef(
            fields.get("trellis"), fields.get("suh"), fields.get("svh"), None, None, fields.get("mcg"),
            fields.get("mul1"), extra)}
    ckpt.layers = dict(sorted(ckpt.layers.items()))


def is_rank_name(name: str) -> bool:
    return RANK_NAME.match(name) is not None


def is_routed_name(name: str) -> bool:
    """A routed-expert tensor of this layout (what a conversion rewrites rather than carries)."""
    return UNDER_EXPERTS.match(name) is not None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
