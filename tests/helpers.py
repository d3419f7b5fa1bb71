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

from corrupt import edit_json
from trellis_cli.cli.app import main
from trellis_cli.dialects.routepack.manifest import write_manifest
from trellis_cli.checkpoint.architecture import model_weights
from trellis_cli.synth import TINY_GLM_MOE_DSA, preset, write_checkpoint


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


def error_line(err: str) -> str:
    """The `error:` line of a failed run's stderr (a `hint:` line may follow it); "" when there is none."""
    return next((line for line in reversed(err.strip().splitlines()) if line.startswith("error:")), "")


def without_hint(err: str) -> str:
    """stderr without the one `hint:` line that may follow an `error:` line (cli/exit_codes.py)."""
    lines = err.splitlines(keepends=True)
    if lines and lines[-1].startswith("hint: "):
        lines.pop()
    return "".join(lines)


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
    old_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    weight_map: dict = {name: file for name, file in old_map.items() if not file.startswith("model-layer-")}
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
LAYER_FILE_WRITERS = ("trellis_cli.dialects.routepack.tr3_to_route_pack", "trellis_cli.dialects.exl3v1.exl3v1_to_route_pack")


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


def tree_snapshot(root: Path, *, skip: tuple[Path, ...] = ()) -> dict[str, tuple]:
    """Every entry under `root` (links not followed, `skip` subtrees left out): relative path -> ("file", sha256,
    mode), ("link", target) or ("dir",). Two equal snapshots: nothing under `root` was created, changed or
    deleted."""
    import hashlib
    import os

    skipped = {Path(os.path.abspath(p)) for p in skip}
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if Path(os.path.abspath(here / d)) not in skipped)
        for name in [*dirnames, *sorted(filenames)]:
            path = here / name
            rel = path.relative_to(root).as_posix()
            if Path(os.path.abspath(path)) in skipped:
                continue
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mode)
    return out


def exl3v1_from_tr3(root: Path) -> Path:
    """A small exl3-v1 checkpoint converted from TR3 (so its config.json carries the conversion note), at
    root/exl3 (the TR3 source stays at root/tr3)."""
    from trellis_cli import RepackOptions, run_repack
    from trellis_cli.synth import SynthSpec

    spec = SynthSpec(hidden=256, intermediate=512, experts=4, tp=1, layers=(3, 4), uniform_k=4, top_k=2,
                     rotation_layout="shared_h_v1")
    run_repack(str(write_checkpoint(root / "tr3", spec)), root / "exl3", RepackOptions(to="exl3-v1"))
    return root / "exl3"


def flip_tensor_byte(path: Path, tensor: str, at: int = 100) -> None:
    """Flip one byte of `tensor`'s data in a safetensors file (same size: only a hash can tell)."""
    from trellis_cli.header import read_local_header

    header = read_local_header(path, path.name)
    data = bytearray(path.read_bytes())
    data[header.data_start + header.tensors[tensor].begin + at] ^= 0xFF
    path.write_bytes(bytes(data))


def restamp_exl3v1_hashes(root: Path) -> None:
    """Record each layer file's current sha256 in exl3-manifest.json: an edit a producer re-published, which
    conversions then take as the source's own data."""
    import hashlib

    manifest_path = root / "exl3-manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["layers"].values():
        entry["sha256"] = hashlib.sha256((root / entry["file"]).read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest, indent=2))


R7_SCHEMA = "r7-complete-v2-checkpoint-v1"
HIDDEN_SIDE = {"gate_proj": "suh", "up_proj": "suh", "down_proj": "svh"}


def to_r7_v2(root: Path, *, k_values: list | None = None, embed: bool = True) -> Path:
    """A tp=1 synth checkpoint as an R7 v2 (topology-neutral) one the R7 loader version reads: rank-free expert
    names, one layer-shared gate/up suh and down svh per layer (`experts.r7_shared.*`), the R7 block with its
    schema in config.json's quantization_config (or, with `embed=False`, only in quantization_config.json),
    tensor_storage records and per-layer bit maps."""
    config = json.loads((root / "config.json").read_text())
    hybrid = config.pop("hybrid_tr3_tail")
    storage: dict = {}
    weight_map: dict = {}
    manifests: list[str] = []
    used: set[int] = set()
    for shard in sorted(root.glob("model-layer-*.safetensors")):
        tensors = {k.replace(".rank0.", "."): v for k, v in load_file(str(shard)).items()}
        out: dict = {}
        layer_ks: dict[tuple[int, str], int] = {}
        for name, t in tensors.items():
            parts = name.split(".")  # model.layers.L.mlp.experts.E.proj.field
            layer, expert, proj, fieldname = int(parts[2]), int(parts[5]), parts[6], parts[7]
            base = ".".join(parts[:5])
            if fieldname == HIDDEN_SIDE[proj]:
                shared = f"{base}.r7_shared.{'down_svh' if proj == 'down_proj' else 'gate_up_suh'}"
                out.setdefault(shared, t)  # one vector per layer: expert 0's stands for all
                continue
            out[name] = t
            module = name.rsplit(".", 1)[0]
            record = storage.setdefault(module, {"quant_format": "exl3", "stored_tensors": {}})
            record["stored_tensors"].update({f"{module}.{f}": {} for f in ("suh", "svh", fieldname)})
            if fieldname == "trellis":
                record["bits_per_weight"] = t.shape[-1] // 16
                layer_ks[(expert, proj)] = t.shape[-1] // 16
                used.add(t.shape[-1] // 16)
        save_file(out, str(shard), metadata={"format": "pt"})
        weight_map.update({name: shard.name for name in out})
        layer = int(next(iter(out)).split(".")[2])
        name = f"r7-experts-layer-{layer:03d}.json"
        experts = 1 + max(e for e, _ in layer_ks)
        (root / name).write_text(json.dumps([layer_ks[(e, p)] for e in range(experts)
                                             for p in ("gate_proj", "up_proj", "down_proj")]))
        manifests.append(name)
    r7 = {"schema": R7_SCHEMA, "feature": "r7-asymmetric-two-stack", "codebook": "mcg", "bits": "mixed_tensor",
          "moe_layers": hybrid["moe_layers"], "k_values": sorted(used) if k_values is None else k_values,
          "bit_map_manifests": manifests}
    quant = config["quantization_config"]
    external = {"quant_method": "exl3", "tensor_storage": storage}
    if embed:
        quant["r7_routed_experts"] = r7
    else:
        external["r7_routed_experts"] = r7
    (root / "config.json").write_text(json.dumps(config))
    (root / "quantization_config.json").write_text(json.dumps(external))
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if ".mlp.experts." not in k} | weight_map
    index.setdefault("metadata", {})["total_size"] = sum(
        t.numel() * t.element_size() for f in sorted(set(index["weight_map"].values()))
        for t in load_file(str(root / f)).values())
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    (root / "MANIFEST.sha256").unlink()
    return root


def serve_exl3v1(root: Path, *, barrier: bool = True) -> Path:
    """An exl3-v1 checkpoint as the mainline manifest loader wants it: a config.json stamped exl3 that names
    exl3-manifest.json and MXFP8 dense weights, and (with `barrier`) one extent barrier at the halfway slot."""
    manifest = json.loads((root / "exl3-manifest.json").read_text())
    geometry = manifest["geometry"]
    if barrier:
        manifest["layout"]["extent_barriers"] = [geometry["num_slots"] // 2]
        (root / "exl3-manifest.json").write_text(json.dumps(manifest, indent=2))
    layers = geometry["moe_layer_indices"]
    config = {**TINY_GLM_MOE_DSA, "model_type": "glm_moe_dsa", "hidden_size": geometry["hidden_size"],
              "n_routed_experts": geometry["num_experts"], "moe_intermediate_size": geometry["intermediate_size"],
              "num_hidden_layers": max(layers) + 1, "first_k_dense_replace": min(layers),
              "quantization_config": {"quant_method": "exl3", "exl3": {"manifest": "exl3-manifest.json"},
                                      "dense_format": "mxfp8",
                                      "ignored_layers": ["g_proj", "f_a_proj", "f_b_proj", "b_proj", "kv_b_proj"]}}
    (root / "config.json").write_text(json.dumps(config))
    write_model_weights(root / "model-non-expert.safetensors", config)
    return root


def write_model_weights(path: Path, config: dict) -> Path:
    """Every weight the model class loads besides the routed experts (checkpoint/architecture.py), bf16, seeded."""
    gen = torch.Generator().manual_seed(0)
    weights = model_weights(config)
    every = weights.main + [w for layer in sorted(weights.mtp) for w in weights.mtp[layer]]
    return write_tensors(path, {w.name: (0.02 * torch.randn(w.shape, generator=gen)).to(torch.bfloat16) for w in every})


def add_protected(root: Path, prefix: str = "model.layers.0.self_attn.q_proj", *, bits: int = 6,
                  declared: object = None, marker: str = "mcg") -> Path:
    """Give a TR3 checkpoint one protected dense EXL3 tensor (exl3-protected-v1): its trellis at `bits`, fp16
    suh/svh and a codebook marker in a shard of its own, declared in hybrid_tr3_tail.protected_tensor_policy at
    `declared` bits (default: `bits`) and recorded in quantization_config.json's tensor_storage."""
    from trellis_cli.codebooks import BY_NAME

    gen = torch.Generator().manual_seed(47)
    tensors = {f"{prefix}.trellis": torch.randint(-32768, 32767, (16, 16, 16 * bits), dtype=torch.int16,
                                                  generator=gen),
               f"{prefix}.suh": torch.randn(256, generator=gen).half(),
               f"{prefix}.svh": torch.randn(256, generator=gen).half(),
               f"{prefix}.{marker}": torch.tensor(BY_NAME[marker].marker_value, dtype=torch.int32)}
    shard = "model-protected.safetensors"
    save_file(tensors, str(root / shard), metadata={"format": "pt"})
    edit_json(root / "config.json", lambda c: c["hybrid_tr3_tail"].update(protected_tensor_policy={
        "format": "exl3-protected-v1", "tensors": {prefix: {"bits": bits if declared is None else declared,
                                                            "codebook": "mcg"}}}))
    storage = {prefix: {"quant_format": "exl3", "bits_per_weight": bits,
                        "stored_tensors": {name: {"shape": list(t.shape)} for name, t in tensors.items()}}}
    (root / "quantization_config.json").write_text(json.dumps({"quant_method": "exl3", "tensor_storage": storage}))

    def index(doc: dict) -> None:
        doc["weight_map"].update({name: shard for name in tensors})
        doc["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in tensors.values())
    edit_json(root / "model.safetensors.index.json", index)
    (root / "MANIFEST.sha256").unlink()
    return root
