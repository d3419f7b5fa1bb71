"""fit of a local rank-sliced TR3 read as columns (no per-tensor model) against fit of the full opening: the same
document on good sources, and the full opening's answer (refusal included) wherever the columns prove nothing."""

from __future__ import annotations

import json

import pytest

from corrupt import rewrite_header, rewrite_index, shuffled
from helpers import tiny_checkpoint
from trellis_cli import sources
from trellis_cli.checkpoint import reader
from trellis_cli.dialects import open_checkpoint
from trellis_cli.errors import CheckFailed, UsageError
from trellis_cli.fit import run
from trellis_cli.fit.gpus import choose_gpu
from trellis_cli.sources import LocalSource

REQUESTS = [dict(tp=2, gpu="h100", ctx=2048), dict(tp=1, gpu="h100", ctx=2048), dict(tp=2, gpu="b200", mtp=True)]


def request(tp, gpu, **rest):
    return run.FitRequest(tp=tp, gpu=choose_gpu(gpu, None, None), **rest)


def answers(root, r):
    """(columns, full opening) of one request: each the JSON document, or the refusal's words."""
    out = []
    for compute in (lambda: run._from_columns(str(root), r, None), lambda: run.fit(open_checkpoint(root), r)):
        try:
            result = compute()
            out.append(None if result is None else json.dumps(result.to_json(), sort_keys=True))
        except (UsageError, CheckFailed) as e:
            out.append(f"refused: {e}")
    return out


@pytest.mark.parametrize("changes", [{}, {"non_expert": "bf16"}, {"codebook": "3inst"}, {"uniform_k": 4, "partition": None},
                                     {"mtp_layers": 1, "non_expert": "bf16"}, {"tp": 1}])
@pytest.mark.parametrize("asked", REQUESTS)
def test_the_columns_give_the_full_opening_s_answer(tmp_path, changes, asked):
    root = tiny_checkpoint(tmp_path, **changes)
    quick, full = answers(root, request(**asked))
    assert quick is not None and quick == full and not quick.startswith("refused")


def hostile_shard(root, mutate):
    shard = sorted(root.glob("model-layer-*.safetensors"))[0]
    rewrite_header(shard, mutate)
    return shard


def rename(old_part, new_part):
    def mutate(header):
        name = next(n for n in header if old_part in n)
        header[name.replace(old_part, new_part)] = header.pop(name)
    return mutate


def reverse_offsets(header):
    name = next(n for n in header if n.endswith(".trellis"))
    header[name]["data_offsets"] = header[name]["data_offsets"][::-1]


def unknown_dtype(header):
    name = next(n for n in header if n.endswith(".suh"))
    header[name]["dtype"] = "F17"


def metadata_naming(header):
    """Two layers in one shard, and metadata that names the first layer's prefix as often as the second has tensors."""
    assert next(iter(header)) == "__metadata__"  # first, as safetensors writes it
    moved = [n for n in header if n != "__metadata__"][:3]
    for name in moved:
        header[name.replace("model.layers.3.", "model.layers.5.")] = header.pop(name)
    for name in [n for n in header if n.endswith(".mcg")][:3]:  # room for the metadata in the header's length
        header.pop(name)
    header["__metadata__"] = {str(i): "model.layers.3.mlp.experts." for i in range(len(moved))}


@pytest.mark.parametrize("mutate", [metadata_naming, rename(".rank0.", "."), rename("experts.0.", "experts.00."),
                                    rename("gate_proj", "w1"), rename(".suh", ".bias"), reverse_offsets,
                                    unknown_dtype])
def test_a_shard_the_columns_do_not_prove_is_read_in_full(tmp_path, mutate):
    root = tiny_checkpoint(tmp_path)
    hostile_shard(root, mutate)
    r = request(**REQUESTS[0])
    assert run._from_columns(str(root), r, None) is None
    with pytest.raises((UsageError, CheckFailed)) if mutate in (reverse_offsets, unknown_dtype) else _nothing():
        run.fit_source(str(root), r)


@pytest.mark.parametrize("which", ["experts", "other weights"])
def test_a_truncated_shard_is_refused_as_the_full_opening_refuses_it(tmp_path, which):
    root = tiny_checkpoint(tmp_path, non_expert="bf16")
    shards = sorted(root.glob("*.safetensors"))
    shard = next(p for p in shards if (b".mlp.experts." in p.read_bytes()[:1 << 16]) == (which == "experts"))
    shard.write_bytes(shard.read_bytes()[:-1])
    r = request(**REQUESTS[0])
    assert run._from_columns(str(root), r, None) is None
    with pytest.raises(CheckFailed, match="file.truncated|file.changed|past the end"):
        run.fit_source(str(root), r)


def large_index(monkeypatch, root):
    """The index read as a production one is: above the JSON limit of sources (which every other file stays under)."""
    monkeypatch.setattr(sources, "MAX_JSON_BYTES", (root / "model.safetensors.index.json").stat().st_size - 1)


@pytest.mark.parametrize("piece", [8 << 20, 1000, 37])
@pytest.mark.parametrize("indent", [None, 2])
def test_a_large_index_is_proven_in_its_bytes(tmp_path, monkeypatch, piece, indent):
    root = tiny_checkpoint(tmp_path)
    index = root / "model.safetensors.index.json"
    index.write_text(json.dumps(json.loads(index.read_text()), indent=indent))
    monkeypatch.setattr(reader, "_INDEX_PIECE", piece)  # split in pieces of whole entries, wherever they fall
    large_index(monkeypatch, root)
    source = LocalSource(root)
    assert reader.index_files(source, reader.listing(source)) == {p.name for p in root.glob("*.safetensors")}
    quick, full = answers(root, request(**REQUESTS[0]))
    assert quick is not None and quick == full and not quick.startswith("refused")


@pytest.mark.parametrize("edit", [
    lambda text: text.replace('"weight_map":{', '"weight_map":{"twice":"a.safetensors","twice":"a.safetensors",'),
    lambda text: text.replace('"weight_map":{', '"weight_map":{"a\nb":"a.safetensors",'),
    lambda text: text[:-2] + ",}}",
    lambda text: text.replace('"weight_map":{', '"weight_map":{"a\\u0041":"a.safetensors",'),
    lambda text: text.replace('"weight_map":{', '"weight_map":{"a":1,'),
    lambda text: text[:-2],
])
def test_an_index_the_bytes_do_not_prove_is_read_in_full(tmp_path, monkeypatch, edit):
    root = tiny_checkpoint(tmp_path)
    index = root / "model.safetensors.index.json"
    index.write_text(edit(json.dumps(json.loads(index.read_text()), separators=(",", ":"))))
    large_index(monkeypatch, root)
    source = LocalSource(root)
    assert reader.index_files(source, reader.listing(source)) is None
    quick, full = answers(root, request(**REQUESTS[0]))
    assert quick == full or (quick is None and full.startswith("refused: model.safetensors.index.json"))


def test_an_index_naming_a_missing_shard_is_refused_by_name(tmp_path, monkeypatch):
    root = tiny_checkpoint(tmp_path)
    index = root / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.norm.weight"] = "absent.safetensors"
    index.write_text(json.dumps(doc))
    large_index(monkeypatch, root)
    r = request(**REQUESTS[0])
    assert run._from_columns(str(root), r, None) is None
    with pytest.raises(CheckFailed, match="index.file-missing"):
        run.fit_source(str(root), r)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---- the index proven by writing it again from the shards' names (`reader._rebuilt_index`) ---------------------

def shard_names(root):
    source = LocalSource(root)
    shards = reader.shard_columns(source, reader.listing(source), lambda *_args: None)
    assert shards is not None
    return shards.names()


def rebuilt(root):
    source = LocalSource(root)
    return reader._rebuilt_index(source, reader.listing(source), shard_names(root))


@pytest.mark.parametrize("changes", [{}, {"non_expert": "bf16"}, {"tp": 1}])
def test_the_columns_name_every_tensor_as_the_parsed_headers_do(tmp_path, changes):
    """Each shard's names as the columns read them from the raw bytes: the parsed header's, in its order."""
    root = tiny_checkpoint(tmp_path, **changes)
    names = shard_names(root)
    headers = open_checkpoint(root).headers
    assert names is not None and set(names) == {file for file, header in headers.items() if header.tensors}
    for file, shard in names.items():
        assert list(shard.listed()) == list(headers[file].tensors) and shard.tensors == len(headers[file].tensors)


INDEX_FORMS = {  # (how the index is written again, whether the rebuild proves it)
    "as written": (None, {}, True),
    "compact": (None, dict(separators=(",", ":")), True),
    "indent=2": (None, dict(indent=2), True),
    "sorted": (None, dict(sort_keys=True), True),
    "sorted, indent=2": (None, dict(sort_keys=True, indent=2), True),
    "shuffled": (shuffled, {}, False),
    "shuffled, indent=2": (shuffled, dict(indent=2), False),
}


@pytest.mark.parametrize("form", INDEX_FORMS)
@pytest.mark.parametrize("changes", [{}, {"non_expert": "bf16"}])
def test_a_large_index_rebuilt_from_the_names_gives_the_same_fit(tmp_path, monkeypatch, form, changes):
    """Proven by the rebuild where it is written as writers write one, by the streamed proof where not (shuffled):
    the same files named either way, and the full opening's document."""
    root = tiny_checkpoint(tmp_path, **changes)
    edit, dumps, proves = INDEX_FORMS[form]
    rewrite_index(root, edit or (lambda _wm: None), **dumps)
    large_index(monkeypatch, root)
    assert (rebuilt(root) is not None) == proves
    source = LocalSource(root)
    files = reader.listing(source)
    named = reader.index_files(source, files, shard_names(root))
    assert named == reader.index_files(source, files) == {p.name for p in root.glob("*.safetensors")}
    quick, full = answers(root, request(**REQUESTS[0]))
    assert quick is not None and quick == full and not quick.startswith("refused")


INDEX_DAMAGE = {
    "a name dropped": lambda wm: wm.pop(next(iter(wm))),
    "an extra name": lambda wm: wm.update({"model.layers.3.mlp.experts.0.up_proj.extra": next(iter(wm.values()))}),
    "a name moved to another shard": lambda wm: wm.update({next(iter(wm)): sorted(set(wm.values()))[-1]}),
    "a missing shard": lambda wm: wm.update({next(iter(wm)): "absent.safetensors"}),
    "a path leaving the checkpoint": lambda wm: wm.update({next(iter(wm)): "../outside.safetensors"}),
}


@pytest.mark.parametrize("edit", INDEX_DAMAGE)
@pytest.mark.parametrize("dumps", [dict(separators=(",", ":")), dict(sort_keys=True, indent=2)])
def test_an_index_that_disagrees_with_the_names_is_not_rebuilt_and_fits_the_same(tmp_path, monkeypatch, edit, dumps):
    root = tiny_checkpoint(tmp_path)
    rewrite_index(root, INDEX_DAMAGE[edit], **dumps)
    large_index(monkeypatch, root)
    assert rebuilt(root) is None
    quick, full = answers(root, request(**REQUESTS[0]))
    assert quick == full or (quick is None and full.startswith("refused: "))
    if edit in ("a missing shard", "a path leaving the checkpoint"):
        assert quick is None and full.startswith("refused: ")


def test_shards_of_one_layer_give_no_names_to_rebuild_from(tmp_path):
    """Two shards of one MoE layer (here each name in both): the index is left to the streamed proof."""
    root = tiny_checkpoint(tmp_path)
    first, second = sorted(root.glob("model-layer-*.safetensors"))[:2]
    layer, other = (int(p.stem.rsplit("-", 1)[1]) for p in (first, second))
    assert len(str(layer)) == len(str(other))  # (the header keeps its length)

    def same_layer(header):
        for name in [n for n in header if n != "__metadata__"]:
            header[name.replace(f"model.layers.{other}.", f"model.layers.{layer}.")] = header.pop(name)

    rewrite_header(second, same_layer)
    source = LocalSource(root)
    found = reader.shard_columns(source, reader.listing(source), lambda *_args: None)
    assert found is not None and found.names() is None


@pytest.mark.parametrize("dumps", [dict(separators=(",", ":")), dict(indent=2), dict(sort_keys=True)])
def test_the_cli_refuses_an_index_naming_a_missing_shard_by_name(tmp_path, monkeypatch, capsys, dumps):
    from helpers import run_cli

    root = tiny_checkpoint(tmp_path)
    rewrite_index(root, lambda wm: wm.update({"model.norm.weight": "absent.safetensors"}), **dumps)
    large_index(monkeypatch, root)
    code, out, err = run_cli(capsys, "fit", str(root), "--tp", "2", "--gpu", "h100", "--ctx", "2048")
    assert code == 1 and "index.file-missing" in out + err and "absent.safetensors" in out + err
