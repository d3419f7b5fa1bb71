"""The loopback Hub serves files from disk: sizes from stat, ranges read from the file, an LFS sha256 given or
computed only when a response needs it, and a commit that is a snapshot unless served in place. The real
huggingface_hub client is the one that asks."""

from __future__ import annotations

import hashlib
import json
import struct
import urllib.request
from pathlib import Path

import torch
from huggingface_hub import HfApi, hf_hub_download
from safetensors.torch import save_file

from hub_server import HubServer

GIB = 1 << 30


def sparse_safetensors(path: Path, data_bytes: int) -> int:
    """A safetensors file with one U8 tensor of `data_bytes` left as a hole; returns the header's length."""
    header = json.dumps({"hole": {"dtype": "U8", "shape": [data_bytes], "data_offsets": [0, data_bytes]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + data_bytes)
    return len(header)


def ranged(hub: HubServer, repo: str, name: str, first: int, last: int) -> bytes:
    request = urllib.request.Request(f"{hub.endpoint}/{repo}/resolve/main/{name}",
                                     headers={"Range": f"bytes={first}-{last}"})
    with urllib.request.urlopen(request) as response:  # follows the LFS redirect
        assert response.status == 206
        return response.read()


def test_a_sparse_file_in_place_is_served_by_ranges_without_hashing(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    n = sparse_safetensors(root / "model.safetensors", 4 * GIB)
    declared = hashlib.sha256(b"declared").hexdigest()
    with HubServer() as hub:
        hub.add_commit("org/sparse", root, in_place=True, lfs_sha256={"model.safetensors": declared})
        [info] = HfApi(endpoint=hub.endpoint).get_paths_info("org/sparse", ["model.safetensors"])
        assert info.size == 4 * GIB + 8 + n and info.lfs.sha256 == declared
        assert ranged(hub, "org/sparse", "model.safetensors", 0, 7) == struct.pack("<Q", n)
        assert hub.total_tensor_bytes() == 0
        assert ranged(hub, "org/sparse", "model.safetensors", 8 + n, 8 + n + 99) == bytes(100)
        assert hub.bytes_served[("org/sparse", "model.safetensors")] == 108
        assert hub.total_tensor_bytes() == 100


def test_a_commit_is_a_snapshot_and_its_hashes_are_the_contents(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    tensors = {"w": torch.randn(64, 32)}
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text('{"model_type": "test"}')
    original = (root / "model.safetensors").read_bytes()
    config = (root / "config.json").read_bytes()
    with HubServer() as hub:
        hub.add_commit("org/snap", root)
        served = hub.repos["org/snap"].commits[hub.repos["org/snap"].refs["main"]]
        assert served["model.safetensors"].known_sha256 is None  # nothing hashed before a response needs it
        save_file({"w": torch.randn(64, 32)}, root / "model.safetensors")  # the directory changes afterwards
        (root / "config.json").write_text('{"model_type": "changed"}')
        api = HfApi(endpoint=hub.endpoint)
        by_name = {e.path: e for e in api.get_paths_info("org/snap", ["model.safetensors", "config.json"])}
        assert by_name["model.safetensors"].lfs.sha256 == hashlib.sha256(original).hexdigest()
        assert by_name["config.json"].blob_id == hashlib.sha1(b"blob %d\0" % len(config) + config).hexdigest()
        # The client checks the whole download against the listed sha256.
        downloaded = hf_hub_download("org/snap", "model.safetensors", endpoint=hub.endpoint,
                                     cache_dir=tmp_path / "cache")
        assert Path(downloaded).read_bytes() == original
        assert hub.total_tensor_bytes() == len(original) - 8 - struct.unpack("<Q", original[:8])[0]
