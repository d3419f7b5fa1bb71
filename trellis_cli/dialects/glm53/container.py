"""The GLM-5.3 unsliced stream in the normalized model: headers read, routed experts parsed by the loader's own
schema (`model.language_model.layers.{L}.mlp.experts.{E}.{proj}.{field}`, no rank segment), one LinearRef per
(layer, expert, projection) at rank 0, `tp` 1 (the stored layout is unsliced; a server cuts it at load).

The shared shard reader reads `model.layers.` names only (and rightly calls these non-canonical for TR3), so
this dialect reads its headers itself. What cannot be read becomes a parse finding, never an exception.
"""

from __future__ import annotations

from typing import Any

from trellis_cli.checkpoint.model import Checkpoint, LinearRef, MoeLayer, TensorRef
from trellis_cli.dialects.glm53.contract import EXPERT_NAME, FIELDS, RANK_NAME, UNDER_EXPERTS, text_config
from trellis_cli.errors import CheckFailed
from trellis_cli.findings import Location, error
from trellis_cli.header import safe_relative

INDEX = "model.safetensors.index.json"


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
    ckpt.declared["inferred"] = []


def _read_headers(ckpt: Checkpoint, files: dict[str, int]) -> None:
    source = ckpt.source
    escapes = getattr(source, "escapes", None)
    for name, size in files.items():
        if not name.endswith(".safetensors"):
            continue
        if not safe_relative(name) or (escapes is not None and escapes(name)):
            ckpt.parse_findings.append(error("path.escape", Location(file=name),
                                             "file resolves outside the checkpoint directory (symlink or path)"))
            continue
        if size < 0:
            ckpt.parse_findings.append(error("path.dangling", Location(file=name),
                                             "file is a dangling link (or a symlink loop)"))
            continue
        try:
            ckpt.headers[name] = source.read_header(name)
        except CheckFailed as e:  # SourceUnavailable (network, auth) propagates: exit 3, not a finding
            message = str(e)
            detail = message[len(name) + 2:] if message.startswith(name + ": ") else message
            ckpt.parse_findings.append(error(e.code or "file.header", Location(file=name), detail))
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
    if INDEX not in files:
        return
    try:
        data: Any = ckpt.source.read_json(INDEX)
    except CheckFailed as e:
        ckpt.parse_findings.append(error(e.code or "json.unreadable", Location(file=INDEX), str(e)))
        return
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        ckpt.parse_findings.append(error("index.format", Location(file=INDEX),
                                         "index has no weight_map object of tensor -> file strings"))
        return
    ckpt.index, ckpt.index_file = dict(weight_map), INDEX
    ckpt.declared["index_metadata"] = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}


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
            any_ref.name.rsplit(".", 1)[0], fields.get("trellis"), fields.get("suh"), fields.get("svh"),
            None, None, fields.get("mcg"), fields.get("mul1"), extra)}
    ckpt.layers = dict(sorted(ckpt.layers.items()))


def is_rank_name(name: str) -> bool:
    return RANK_NAME.match(name) is not None


def is_routed_name(name: str) -> bool:
    """A routed-expert tensor of this layout (what a conversion rewrites rather than carries)."""
    return UNDER_EXPERTS.match(name) is not None


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
