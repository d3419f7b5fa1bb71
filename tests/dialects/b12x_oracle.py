"""Run inside a b12x release (PYTHONPATH pointing at it): b12x's own container reader and synthetic writer as
the oracle of tests/dialects/test_btx.py. Imports nothing of trellis.

    python b12x_oracle.py read ROOT          every layer's barrier segments, whole and halved, read with verify_sha: digests as JSON
    python b12x_oracle.py write ROOT CONFIG  b12x's synthetic writer, CONFIG a JSON object of its config fields
    python b12x_oracle.py manifest ROOT...   the manifest parser alone, per root: {"ok": true} or {"error": ...}
    python b12x_oracle.py trellis-config QS  TrellisConfig.from_quantization_config of each of QS (a JSON
                                             list): {"ok": true} or {"error": ...} per block

BTX (b12x 1.3.0) or exl3-v1 (b12x 1.5.x), whichever the release has; tensor names are reported in exl3-v1
words so both sides compare directly. The kernels package imports CUDA bindings, so it is registered empty.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys
import types


def _modules():
    import b12x.moe._shared as shared

    name = "b12x.moe._shared.kernels"
    if name not in sys.modules:
        stub = types.ModuleType(name)
        stub.__path__ = [str(pathlib.Path(shared.__path__[0]) / "kernels")]
        sys.modules[name] = stub
    try:
        from b12x.moe._shared.kernels.w4a16 import btx as reader, btx_synth as synth

        return "btx", reader.read_btx_manifest, reader.read_btx_layer, synth
    except ImportError:
        from b12x.moe.checkpoints import exl3 as reader
        from b12x.moe._shared.kernels.w4a16 import exl3_synth as synth

        return "exl3-v1", reader.read_exl3_manifest, reader.read_exl3_layer, synth


RENAMED = {"atoms": "codes", "rotation_draws": "sign_pattern"}


def _digest(tensor) -> str | None:
    if tensor is None:
        return None
    import torch

    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def read(root: str) -> dict:
    kind, read_manifest, read_layer, _ = _modules()
    manifest = read_manifest(root)
    geometry = manifest.geometry
    slots = getattr(geometry, "atom_slots", None) or geometry.num_slots
    out: dict = {"container": kind, "codebook": manifest.codebook, "extents": {}}
    bounds = (0, *manifest.layout.extent_barriers, slots)
    align = manifest.layout.extent_alignment_slots
    extents = []
    for first, end in zip(bounds, bounds[1:]):  # each barrier segment whole, then halved where aligned
        extents.append((first, end - first))
        if (end - first) // 2 % align == 0:
            extents += [(first, (end - first) // 2), (first + (end - first) // 2, (end - first) // 2)]
    for layer in geometry.moe_layer_indices:
        for first, count in extents:
            got = read_layer(root, manifest, layer, first_slot=first, slot_count=count, verify_sha=True)
            fields = {RENAMED.get(n, n): _digest(getattr(got, n)) for n in (
                "atoms" if kind == "btx" else "codes", "rotations", "gate_suh", "up_suh", "down_svh",
                "rates_fc1", "rates_fc2", "rotation_draws" if kind == "btx" else "sign_pattern")}
            out["extents"][f"{layer}/{first}+{count}"] = fields
    return out


def write(root: str, config: dict) -> dict:
    import torch

    kind, _, _, synth = _modules()
    tables = config.pop("rate_tables", None)
    if tables is not None:
        config["rate_tables"] = {int(k): tuple(torch.tensor(t, dtype=torch.uint8) for t in v)
                                 for k, v in tables.items()}
    config["moe_layer_indices"] = tuple(config["moe_layer_indices"])
    config["extent_barriers"] = tuple(config.get("extent_barriers", ()))
    if kind == "btx":
        config = {{"intermediate_hadamard": "coupled", "row_alignment": "atom_row_alignment"}.get(k, k): v
                  for k, v in config.items()}
        synth.write_btx_checkpoint(root, synth.BtxSynthConfig(**config))
    else:
        synth.write_exl3_checkpoint(root, synth.Exl3SynthConfig(**config))
    return {"container": kind}


def manifests(roots: list[str]) -> list[dict]:
    _, read_manifest, _, _ = _modules()
    out: list[dict] = []
    for root in roots:
        try:
            read_manifest(root)
        except (ValueError, TypeError, KeyError) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
        else:
            out.append({"ok": True})
    return out


def trellis_configs(quants: str) -> list[dict]:
    from b12x.moe.fused_moe.config import TrellisConfig

    out: list[dict] = []
    for quant in json.loads(quants):
        try:
            TrellisConfig.from_quantization_config(quant)
        except (ValueError, TypeError) as e:
            out.append({"error": f"{type(e).__name__}: {e}"})
        else:
            out.append({"ok": True})
    return out


if __name__ == "__main__":
    verb, *args = sys.argv[1:]
    if verb == "read":
        result = read(args[0])
    elif verb == "write":
        result = write(args[0], json.loads(args[1]))
    elif verb == "manifest":
        result = manifests(args)
    else:
        result = trellis_configs(args[0])
    print(json.dumps(result))
