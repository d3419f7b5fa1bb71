"""Round-trip fixtures for repack: TR3 sources in other shard layouts, and the every-tensor comparison.

`relayout` rewrites a synth checkpoint so its tensors (plus non-expert ones such as an embedding and an
lm_head) lie in the shards a `place(name)` function picks, with a matching index and MANIFEST.sha256.
`stored_tensors` reads every tensor of every safetensors file under a directory as stored (dtype string,
shape, sha256 of the raw bytes), straight from the headers, so the comparison depends on no writer or
loader of the project. `assert_same_tensors` is the one check every round-trip test makes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from trellis_cli.integrity import CHECKSUM_MANIFEST, write_manifest
from helpers import all_tensors
from helpers import write_tensors as write_file

INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


class Stored(NamedTuple):
    file: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str


def stored_tensors(root: Path) -> dict[str, Stored]:
    """Every tensor under `root` (nested folders included); a name stored twice fails the test."""
    out: dict[str, Stored] = {}
    for path in sorted(root.rglob("*.safetensors")):
        rel = path.relative_to(root).as_posix()
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                begin, end = entry["data_offsets"]
                f.seek(8 + n + begin)
                digest = hashlib.sha256(f.read(end - begin)).hexdigest()
                assert name not in out, f"{name} stored twice: {out[name].file} and {rel}"
                out[name] = Stored(rel, entry["dtype"], tuple(entry["shape"]), digest)
    return out


def assert_same_tensors(source: Path, back: Path) -> None:
    """Names, dtypes, shapes and bytes of every tensor of `source` are those of `back`, and nothing more."""
    want, got = stored_tensors(source), stored_tensors(back)
    missing, added = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    assert not missing and not added, f"missing {missing[:5]} ({len(missing)}), added {added[:5]} ({len(added)})"
    for name, stored in want.items():
        assert got[name][1:] == stored[1:], (name, stored, got[name])


def non_expert_tensors(hidden: int, vocab: int = 512) -> dict[str, torch.Tensor]:
    """An embedding and an lm_head as a real checkpoint carries them (bf16), with seeded data; the default
    vocabulary is the tiny preset's, so they replace its own with the shapes the model class allocates."""
    gen = torch.Generator().manual_seed(7)
    return {EMBED: torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16),
            LM_HEAD: torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16),
            "model.norm.weight": torch.ones(hidden, dtype=torch.float16)}


def relayout(source: Path, target: Path, place: Callable[[str], str],
             extra: dict[str, torch.Tensor] | None = None) -> Path:
    """A copy of `source` whose tensors (and `extra`) lie in the shard `place(name)` names, in source order."""
    target.mkdir(parents=True)
    for name in ("config.json", "tier_bitmap.json"):
        shutil.copyfile(source / name, target / name)
    tensors = {**all_tensors(source, nested=True), **(extra or {})}
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        shards.setdefault(place(name), {})[name] = tensor
    for shard, members in shards.items():
        (target / shard).parent.mkdir(parents=True, exist_ok=True)
        write_file(target / shard, members, {"format": "pt"})
    weight_map = {name: shard for shard, members in shards.items() for name in members}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (target / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    rewrite_checksums(target)
    return target


def rewrite_checksums(root: Path) -> None:
    """MANIFEST.sha256 over every file under `root`, as a publisher would write it."""
    write_manifest(root, [p.relative_to(root).as_posix() for p in root.rglob("*")
                          if p.is_file() and p.name != CHECKSUM_MANIFEST])


def layer_of(name: str) -> int | None:
    """The MoE layer of a routed-expert tensor name, None for anything else."""
    parts = name.split(".")
    if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3:5] == ["mlp", "experts"]:
        return int(parts[2])
    return None


def rank_of(name: str) -> int | None:
    part = next((p for p in name.split(".") if p.startswith("rank") and p[4:].isdigit()), None)
    return None if part is None else int(part[4:])


def _per_layer(name: str) -> str:
    layer = layer_of(name)
    if layer is not None:
        return f"model-layer-{layer:03d}.safetensors"
    return "model-layer-003.safetensors" if name == EMBED else "model-layer-004.safetensors"


def _split(name: str) -> str:
    first = (layer_of(name) == 3 and rank_of(name) == 0) or name == EMBED
    return "model-00001-of-00002.safetensors" if first else "model-00002-of-00002.safetensors"


# Shard layouts of the tiny preset (MoE layers 3 and 4, TP 2) plus an embedding, an lm_head and a norm.
LAYOUTS: dict[str, Callable[[str], str]] = {
    "shard-per-layer": _per_layer,  # each layer shard also holds non-expert tensors
    "one-shard": lambda name: "model-00001-of-00001.safetensors",  # both layers in one shard
    "layer-split": _split,  # layer 3 over two shards, one of them with the embedding
    "non-expert-shard": lambda name: (f"model-layer-{layer_of(name):03d}.safetensors" if layer_of(name) is not None
                                      else "model-non-expert.safetensors"),
    "nested": lambda name: f"shards/{_per_layer(name)}",
}

DERIVED = ("config.json", INDEX, CHECKSUM_MANIFEST)  # written anew by --to tr3 (config.json compared on its own)


def assert_same_files(source: Path, back: Path) -> None:
    """Every file of `source` is in `back` under its name; files other than shards and DERIVED byte for byte."""
    names = lambda root: sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())  # noqa: E731
    assert names(source) == names(back)
    for name in names(source):
        if not name.endswith(".safetensors") and name not in DERIVED:
            assert (source / name).read_bytes() == (back / name).read_bytes(), name
