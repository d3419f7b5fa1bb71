"""What several test files share: the in-process CLI runner and small checkpoint builders and readers.

Test files import from here (as from corrupt.py), never from each other.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from trellis_cli.cli.app import main
from trellis_cli.routepack.manifest import write_manifest
from trellis_cli.synth import preset, write_checkpoint


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of one in-process `trellis ARGS...` run (`trellis_cli.cli.app.main`); with
    `capsys` None the output is left to pytest's capture and comes back empty."""
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return code, out, err


def run_cli_merged(capsys, *args: str) -> tuple[int, str]:
    """Exit code and stdout + stderr together of one in-process `trellis` run."""
    code, out, err = run_cli(capsys, *args)
    return code, out + err


def tiny_checkpoint(tmp_path: Path, name: str = "ckpt", **changes) -> Path:
    """The `tiny` synth preset with `changes` to its SynthSpec, written to tmp_path / name."""
    return write_checkpoint(tmp_path / name, replace(preset("tiny"), **changes))


def to_plain_exl3(root: Path) -> Path:
    """Turn a tp=1 synth checkpoint into a plain exllamav3 one: no rank segments, tensor_storage metadata."""
    config = json.loads((root / "config.json").read_text())
    config.pop("hybrid_tr3_tail")
    (root / "config.json").write_text(json.dumps(config))
    storage: dict = {}
    weight_map: dict = {}
    for shard in sorted(root.glob("model-layer-*.safetensors")):
        tensors = {k.replace(".rank0.", "."): v for k, v in load_file(str(shard)).items()}
        save_file(tensors, str(shard), metadata={"format": "pt"})
        for name, t in tensors.items():
            module = name.rsplit(".", 1)[0]
            weight_map[name] = shard.name
            if name.endswith(".trellis"):
                storage[module] = {"quant_format": "exl3", "bits_per_weight": t.shape[-1] // 16}
    (root / "quantization_config.json").write_text(json.dumps({"quant_method": "exl3", "tensor_storage": storage}))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"] = weight_map
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "MANIFEST.sha256").unlink()
    return root


def to_r7(root: Path) -> Path:
    """Declare a synth checkpoint as R7: per-(expert, projection) K maps in bit_map_manifests."""
    config = json.loads((root / "config.json").read_text())
    config.pop("hybrid_tr3_tail")
    bitmap = json.loads((root / "tier_bitmap.json").read_text())
    manifests = []
    for layer, entry in bitmap.items():
        name = f"r7-experts-layer-{int(layer):03d}.json"
        (root / name).write_text(json.dumps([k for k in entry["k"] for _ in range(3)]))
        manifests.append(name)
    config["quantization_config"]["r7_routed_experts"] = {"feature": "r7-asymmetric-two-stack", "bits": "mixed_tensor",
                                                          "k_values": [3, 4, 5], "bit_map_manifests": manifests}
    (root / "config.json").write_text(json.dumps(config))
    return root


def all_tensors(directory: Path, *, nested: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `directory` (and its subfolders with `nested`), by name."""
    out = {}
    for path in sorted(directory.rglob("*.safetensors") if nested else directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """The same names, dtypes, shapes and bytes."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


def edited_pack(pack: Path, target: Path, edit) -> Path:
    """A copy of route pack `pack` whose manifest `edit(doc)` changed, rewritten with a matching self-hash."""
    shutil.copytree(pack, target)
    doc = json.loads((target / "manifest.json").read_text(encoding="utf-8"))
    edit(doc)
    write_manifest(target, doc)
    return target


def write_tensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> Path:
    """A small safetensors file through the project's streaming writer (the layouts tests build sources with it)."""
    from trellis_cli.stwriter import SafetensorsWriter, planned

    with SafetensorsWriter(path, [planned(n, t) for n, t in tensors.items()], metadata) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    return Path(path)


class Interrupted(RuntimeError):
    """What `interrupt_after` raises: a repack stopped part way, as a kill or Ctrl-C would stop it."""


# The modules whose route-pack drivers write layer files (each imported write_layer_pack by name).
LAYER_FILE_WRITERS = ("trellis_cli.repack.run", "trellis_cli.repack.exl3v1.to_route_pack")


def interrupt_after(monkeypatch, files: int, error: type[BaseException] = Interrupted) -> None:
    """Make the next repack raise `error` (Interrupted, or KeyboardInterrupt for Ctrl-C) as it starts its layer
    file number files + 1 (no byte of it written), so that its stage holds `files` finished layer files: the
    state an interrupted run leaves."""
    import importlib
    import threading

    lock, started = threading.Lock(), [0]
    for name in LAYER_FILE_WRITERS:
        module = importlib.import_module(name)
        write = module.write_layer_pack

        def interrupting(*args, _write=write, **kwargs):
            with lock:
                started[0] += 1
                if started[0] > files:
                    raise error(f"interrupted after {files} layer file(s)")
            return _write(*args, **kwargs)

        monkeypatch.setattr(module, "write_layer_pack", interrupting)


def many_findings_checkpoint(root: Path) -> Path:
    """A sparse (all-zero data) tiny-shaped checkpoint with 256 experts over 4 layers: 12,288 data.zero-vector
    errors under --deep, and valid headers otherwise."""
    return write_checkpoint(root, replace(preset("tiny"), sparse=True, experts=256, partition=(192, 64),
                                          layers=(3, 4, 5, 6)))


def tensor_bytes(root: Path, pattern: str = "*.safetensors") -> dict[tuple[str, str], tuple]:
    """Every tensor of every matching safetensors file: (file, name) -> (dtype, shape, bytes)."""
    out = {}
    for path in sorted(root.glob(pattern)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[path.name, name] = (t.dtype, tuple(t.shape), t.contiguous().view(-1).numpy().tobytes())
    return out


def exl3v1_specs() -> dict:
    """The two small exl3-v1 checkpoints the conversion tests build: mixed K per expert, and uniform shared-H."""
    from trellis_cli.synth import SynthSpec

    return {
        "pair-per-expert": SynthSpec(hidden=256, intermediate=1024, experts=6, tp=1, layers=(3, 4), partition=(5, 1),
                                     top_k=2),
        "uniform-shared": SynthSpec(hidden=256, intermediate=512, experts=4, tp=1, layers=(3,), uniform_k=4, top_k=2,
                                    rotation_layout="shared_h_v1"),
    }
