"""The bulk layer build (dialects/bulk_layers.py) gives exactly what the per-tensor build gives: the same layers,
experts, linears and records in the same order, the same shared rows and findings; on every dialect the synth
and the helpers write, on every damaged checkpoint of the corpora, and on each way a name can leave the
canonical form. Where it declines, the per-tensor build is the answer. The same holds of the bulk build done
header by header as the headers are read (`LayersAsRead`), and of the model's tensors held as the headers
(`open._tensor_map`): each gives what the build after the reading gives, or steps aside."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from corrupt import CORPUS, READER_CORPUS, SHARD3, SHARD4, read_header, write_header
from helpers import to_plain_exl3, to_r7, to_r7_v2, write_tensors
from trellis_cli.checkpoint.tensor_map import TensorMap, files_named, outside_experts
from trellis_cli.dialects import bulk_layers, open as opening
from trellis_cli.dialects.open import open_checkpoint
from trellis_cli.errors import CheckFailed
from trellis_cli.synth import preset, write_checkpoint


def _state(root: Path) -> object:
    """Everything the layer build decides, in order; or the refusal of the opening."""
    try:
        ck = open_checkpoint(root)
    except CheckFailed as e:
        return ("refused", str(e))
    layers = []
    for li, moe in ck.layers.items():
        experts = [(e, [(p, list(ranks.items())) for p, ranks in projs.items()]) for e, projs in moe.experts.items()]
        layers.append((li, experts, sorted(moe.files), moe.rank_sliced, list(moe.shared_h.items()),
                       list(moe.r7_shared.items()), list(moe.unparsed), moe.declared_k, moe.declared_projection_k))
    findings = [(f.code, f.severity, str(f.where), f.message) for f in ck.parse_findings]
    outside = outside_experts(ck.tensors)
    assert files_named(ck.index) == set(ck.index.values())
    return layers, findings, list(ck.tensors.items()), len(ck.tensors), _lookups(ck.tensors), outside


def _lookups(tensors) -> list[object]:
    """What a lookup answers for every name, near misses of some (another layer, a field, the experts' segment
    changed) and names that are no tensor's, whether the tensors are a dict or held as the headers (`TensorMap`)."""
    names = list(tensors)
    probes: list[object] = [*names, "", "model.layers.", "model.layers.3", "model.layers.3.mlp.experts.",
                            "model.layers.3.mlp.experts", "model.layers.3.self_attn.o_proj.weight", "lm_head.weight",
                            3, None, ("model.layers.3",)]
    for name in names[::max(1, len(names) // 64)]:
        probes += [name[:-1], name + "0", name.replace(".mlp.experts.", ".mlp.expert."),
                   name.replace("layers.3.", "layers.4."), name.replace("layers.4.", "layers.3."),
                   name.replace("layers.", "layers.0"), name.replace(".rank0.", ".rank9.")]
    return [(probe, tensors.get(probe), probe in tensors, tensors.get(probe, "absent")) for probe in probes]


def _both(root: Path, monkeypatch) -> tuple[object, object, bool]:
    """(the layers built as the headers are read, the per-tensor build's, whether a bulk build took them); the
    bulk build after the reading is held equal to the first on the way."""
    taken: list[bool] = []
    as_read_finish, bulk_after = bulk_layers.LayersAsRead.finish, bulk_layers.build_layers_in_bulk

    def spy(build):
        def spied(*args):
            taken.append(build(*args))
            return taken[-1]
        return spied

    with monkeypatch.context() as m:
        m.setattr(bulk_layers.LayersAsRead, "finish", spy(as_read_finish))
        m.setattr(opening, "build_layers_in_bulk", spy(bulk_after))
        as_read = _state(root)
    with monkeypatch.context() as m:  # neither merged nor built as read: both after the reading
        m.setattr(bulk_layers.LayersAsRead, "finish", lambda _self, _ckpt: False)
        m.setattr(opening, "_tensor_map", lambda _ckpt, _read: None)
        m.setattr(opening, "build_layers_in_bulk", spy(bulk_after))
        bulk = _state(root)
    with monkeypatch.context() as m:
        m.setattr(bulk_layers.LayersAsRead, "finish", lambda _self, _ckpt: False)
        m.setattr(opening, "_tensor_map", lambda _ckpt, _read: None)
        m.setattr(opening, "build_layers_in_bulk", lambda *_a: False)
        per_tensor = _state(root)
    assert as_read == bulk
    return as_read, per_tensor, any(taken)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("bulk") / "tiny", preset("tiny"))


def _copy(pristine: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    return root


def _rename(root: Path, shard: str, rename) -> None:
    """Every name of one shard's header through `rename`, in stored order (the header may grow)."""
    _, doc = read_header(root / shard)
    write_header(root / shard, {name if name == "__metadata__" else rename(name): entry for name, entry in doc.items()})


def _tp1(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "tp1", replace(preset("tiny"), tp=1))


# Each builds a checkpoint from the pristine copy; True where the bulk build must take it.
SHAPES = {
    "tr3 per-expert": (lambda root, tmp: root, True),
    "tr3 shared-H": (lambda root, tmp: write_checkpoint(tmp / "sh", replace(preset("tiny"), rotation_layout="shared_h_v1")),
                     True),
    "plain exl3 (no ranks)": (lambda root, tmp: to_plain_exl3(_tp1(tmp)), True),
    "r7": (lambda root, tmp: to_r7(root), True),
    "r7 v2": (lambda root, tmp: to_r7_v2(_tp1(tmp)), True),
    "w1 alias": (lambda root, tmp: _rename(root, SHARD3, lambda n: n.replace(".gate_proj.", ".w1.", 1)) or root, False),
    "one alias among canonical names": (
        lambda root, tmp: _rename(root, SHARD3, lambda n: n.replace("experts.1.gate_proj.", "experts.1.w1.")) or root,
        False),
    "extra field": (lambda root, tmp: _rename(root, SHARD3, lambda n: n.replace("experts.2.up_proj.rank0.mcg",
                                                                                  "experts.2.up_proj.rank0.bias")) or root,
                    False),
    "a rank-less name beside ranked ones": (
        lambda root, tmp: _rename(root, SHARD3, lambda n: n.replace("experts.0.down_proj.rank1.", "experts.0.down_proj.")) or root,
        False),
    "zero-padded expert id": (lambda root, tmp: _rename(root, SHARD4, lambda n: n.replace("experts.3.", "experts.03.")) or root,
                              True),
    "a long expert id": (lambda root, tmp: _rename(root, SHARD4, lambda n: n.replace("experts.3.", "experts.3000000.")) or root,
                         False),
    "non-ASCII name": (lambda root, tmp: _rename(root, SHARD4, lambda n: n.replace("experts.3.", "experts.٣.")) or root,
                       False),
    "unparsed expert tensor": (lambda root, tmp: _rename(root, SHARD4, lambda n: n.replace("experts.3.gate_proj.rank0.suh",
                                                                                         "experts.3.gate_suh")) or root,
                               True),
    "a linear split over two shards": (lambda root, tmp: _move_one(root), False),
    "a name in two shards": (lambda root, tmp: _duplicate_one(root), False),
}


def _move_one(root: Path) -> Path:
    """Layer 4's expert 0 gate_proj rank 0 trellis renamed into layer 3's numbering: a linear of layer 3 with
    fields in both shards."""
    _rename(root, SHARD4, lambda n: n.replace("layers.4.mlp.experts.0.gate_proj.rank0.trellis",
                                              "layers.3.mlp.experts.0.gate_proj.rank0.trellis"))
    _rename(root, SHARD3, lambda n: n.replace("layers.3.mlp.experts.0.gate_proj.rank0.trellis",
                                              "layers.3.mlp.experts.0.gate_proj.rank0.trellis_moved"))
    return root


def _duplicate_one(root: Path) -> Path:
    _, doc = read_header(root / SHARD3)
    name = next(n for n in doc if n.endswith(".trellis"))
    write_tensors(root / "model-extra.safetensors", {name: torch.zeros(doc[name]["shape"], dtype=torch.int16)})
    return root


@pytest.mark.parametrize("shape", list(SHAPES))
def test_both_builds_give_the_same_layers(shape, pristine, tmp_path, monkeypatch):
    make, takes = SHAPES[shape]
    root = make(_copy(pristine, tmp_path), tmp_path)
    bulk, per_tensor, taken = _both(root, monkeypatch)
    assert bulk == per_tensor
    assert taken == takes


@pytest.mark.parametrize("case", sorted(CORPUS) + sorted(READER_CORPUS))
def test_both_builds_agree_on_damaged_checkpoints(case, pristine, tmp_path, monkeypatch):
    root = _copy(pristine, tmp_path)
    damage = CORPUS[case][0] if case in CORPUS else READER_CORPUS[case]
    damage(root)
    bulk, per_tensor, _ = _both(root, monkeypatch)
    assert bulk == per_tensor


def test_other_tensors_between_linears_keep_their_places(pristine, tmp_path, monkeypatch):
    """A shard holding non-expert tensors and shared rows between its linears' fields (stored order by offset)."""
    root = _copy(pristine, tmp_path)
    tensors = load_file(str(root / SHARD3))
    for i, name in enumerate(list(tensors)[::7]):
        tensors[f"model.layers.3.mlp.experts.shared_h.gate_proj.rank{i}.suh"] = torch.ones(4, dtype=torch.float16)
        tensors[f"model.layers.3.self_attn.o{i}.weight"] = torch.ones(2, dtype=torch.float16)
    write_tensors(root / SHARD3, tensors)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"].update({name: SHARD3 for name in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    bulk, per_tensor, taken = _both(root, monkeypatch)
    assert bulk == per_tensor and taken



def _answers(monkeypatch) -> dict[str, list[bool]]:
    """What the tensors held as the headers (`_tensor_map`: whether it took them) and the layers' build read ahead
    (`finish`) answer, call by call."""
    answers: dict[str, list[bool]] = {"tensor_map": [], "finish": []}

    def held(ckpt, read, _original=opening._tensor_map):
        found = _original(ckpt, read)
        answers["tensor_map"].append(found is not None)
        return found

    def finished(self, ckpt, _original=bulk_layers.LayersAsRead.finish):
        answers["finish"].append(_original(self, ckpt))
        return answers["finish"][-1]

    monkeypatch.setattr(opening, "_tensor_map", held)
    monkeypatch.setattr(bulk_layers.LayersAsRead, "finish", finished)
    return answers


def test_a_canonical_checkpoint_is_built_as_its_headers_are_read(pristine, monkeypatch):
    """The common case takes the path read ahead: layers placed header by header, the tensors held as the headers."""
    answers = _answers(monkeypatch)
    assert isinstance(open_checkpoint(pristine).tensors, TensorMap)
    assert answers == {"tensor_map": [True], "finish": [True]}


def _unparsed_expert_tensor(root: Path) -> Path:
    _rename(root, SHARD4, lambda n: n.replace("experts.3.gate_proj.rank0.suh", "experts.3.gate_suh"))
    return root


@pytest.mark.parametrize("make, held", [(_duplicate_one, False), (_unparsed_expert_tensor, True)])
def test_the_builds_read_ahead_step_aside_where_they_cannot_prove_the_answer(make, held, pristine, tmp_path,
                                                                            monkeypatch):
    """A name in two shards sends both back to after the reading (the tensors one dict); another expert tensor in a
    shard (its path runs before any linear is placed) sends the layers back, and is one of the names held apart."""
    answers = _answers(monkeypatch)
    tensors = open_checkpoint(make(_copy(pristine, tmp_path))).tensors
    assert isinstance(tensors, TensorMap) == held
    assert answers == {"tensor_map": [held], "finish": [False]}


# The shapes whose tensors are held as their headers; every other keeps one dict.
HELD = {"tr3 per-expert", "tr3 shared-H", "plain exl3 (no ranks)", "r7", "r7 v2", "zero-padded expert id",
        "unparsed expert tensor"}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_tensors_are_held_as_the_headers_where_no_name_can_be_in_two(shape, pristine, tmp_path):
    make, _ = SHAPES[shape]
    tensors = open_checkpoint(make(_copy(pristine, tmp_path), tmp_path)).tensors
    assert isinstance(tensors, TensorMap) == (shape in HELD)


def test_a_write_turns_the_held_tensors_into_the_dict(pristine):
    """Every write (a name the index maps elsewhere) goes to the dict the opening would have built, in its order."""
    tensors = open_checkpoint(pristine).tensors
    assert isinstance(tensors, TensorMap)
    reference = dict(tensors.items())
    assert tensors.copy() == reference and list(tensors.copy()) == list(reference) and tensors == reference
    first, second, last = list(reference)[0], list(reference)[1], list(reference)[-1]
    views = tensors.keys(), tensors.values(), tensors.items()
    for mapping in (tensors, reference):
        mapping[first] = mapping[last]
        del mapping[second]
        mapping["model.extra"] = mapping[last]
    assert list(tensors.items()) == list(reference.items()) and len(tensors) == len(reference)
    assert [list(view) for view in views] == [list(reference.keys()), list(reference.values()),
                                              list(reference.items())]
    assert _lookups(tensors) == _lookups(reference)
    tensors.clear()
    assert not tensors and list(tensors) == [] and tensors.get(first) is None


def test_the_files_an_index_names_are_read_from_the_held_headers(pristine, monkeypatch):
    """An index proven in its bytes is the tensors' own files (`TensorFiles`); over tensors held as their headers
    the files it names are each header's that holds a tensor: the same set as its ~935k values give, and after a
    write (the dict) read from the values again."""
    from trellis_cli import sources
    from trellis_cli.checkpoint.model import TensorFiles

    monkeypatch.setattr(sources, "MAX_JSON_BYTES", (pristine / "model.safetensors.index.json").stat().st_size - 1)
    ck = open_checkpoint(pristine)
    assert isinstance(ck.index, TensorFiles) and isinstance(ck.tensors, TensorMap)
    assert files_named(ck.index) == set(ck.index.values()) == {f for f in ck.headers if ck.headers[f].tensors}
    last = list(ck.tensors)[-1]
    ck.tensors[last] = ck.tensors[last]._replace(file="elsewhere.safetensors")
    assert files_named(ck.index) == set(ck.index.values()) and "elsewhere.safetensors" in files_named(ck.index)
