"""`trellis repack` from a Hub id: downloads only what the selected layers need, pinned to the resolved sha."""

from __future__ import annotations

import json

from hub_server import HubServer
from trellis_cli import RepackOptions, run_repack
from trellis_cli.dialects.routepack.verify import verify_route_pack
from trellis_cli.sources import open_source
from trellis_cli.synth import preset, write_checkpoint

REPO = "org/tiny-tr3"


def test_repack_from_hub_downloads_only_the_selected_layer(tmp_path):
    served = write_checkpoint(tmp_path / "served", preset("tiny"))
    with HubServer() as hub:
        sha = hub.add_commit(REPO, served)
        source = open_source(REPO, endpoint=hub.endpoint, cache_dir=tmp_path / "cache")
        run_repack(source, tmp_path / "out", RepackOptions(layers="4", copy_other=False))
        downloads = {path.rsplit("/", 1)[-1] for method, path, byte_range, _ in hub.requests
                     if method == "GET" and byte_range is None}  # ranged reads fetch headers only
    assert "model-layer-004.safetensors" in downloads and "model-layer-003.safetensors" not in downloads
    doc = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert doc["source"]["kind"] == "hub" and doc["source"]["repo_id"] == REPO and doc["source"]["revision"] == sha
    assert "model-layer-004.safetensors" in doc["source"]["files"]
    assert verify_route_pack(tmp_path / "out").ok
