"""`trellis bench --compare exllamav3` on a GPU with the peer installed (skipped otherwise): the peer's
per-tier modules compute the layer, and the CLI reports its time beside ours."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import requires_gpu
from helpers import run_cli
from trellis_cli.bench.peer_compare import PEER_LIMIT
from trellis_cli.bench.peer_exllamav3 import load_peer, locate_peer, peer_layer, split_routes
from trellis_cli.bench.smoke import rel_l2
from trellis_cli.bench.synthetic import Preset, random_activations, random_routes, synthetic_pack
from trellis_cli.reference import layer_pack_forward

LOCATION = locate_peer()
requires_peer = pytest.mark.skipif(isinstance(LOCATION, str), reason=f"exllamav3: {LOCATION}")
pytestmark = [requires_gpu, requires_peer, pytest.mark.gpu]

SMALL = Preset("small", 1024, 512, 32, 8, "mcg", (24, 8), (3, 4), 1)  # the production I_r


@pytest.fixture(scope="module")
def api():
    found = load_peer(LOCATION)
    if isinstance(found, str):
        pytest.fail(f"exllamav3 is installed but its MoE layer does not import: {found}")
    return found


@pytest.mark.parametrize("shared_h", [False, True])
@pytest.mark.parametrize("m", [1, 5, 40, 300])
def test_peer_tiers_compute_the_layer(api, shared_h, m):
    pack = synthetic_pack(dataclasses.replace(SMALL, shared_h=shared_h), device="cuda", seed=m)
    tiers = peer_layer(api, pack, 8)
    x = random_activations(m, pack.hidden, device="cuda", seed=m + 1)
    ids, weights = random_routes(m, 32, 8, device="cuda", seed=m + 2)
    peer = sum(t.forward(x.half(), *r) for t, r in zip(tiers, split_routes(pack, ids, weights)))
    assert peer.dtype == torch.float32 and peer.shape == x.shape
    assert rel_l2(peer, layer_pack_forward(pack, x, ids, weights)) <= PEER_LIMIT


def test_cli_reports_the_peer_beside_ours(capsys):
    code, out, err = run_cli(capsys, "bench", "--synthetic", "glm52-tp4", "--compare", "exllamav3", "--m", "1,64",
                             "--warm", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["compare"]["peer"] == "exllamav3" and doc["compare"]["skipped"] is None
    for row in doc["rows"]:
        entry = row["compare"]
        assert entry["agrees"] and entry["rel_l2"] <= PEER_LIMIT and len(entry["per_tier_us"]) == 2
        assert entry["us"] == pytest.approx(sum(entry["per_tier_us"]))
        assert entry["ratio"] == pytest.approx(entry["us"] / row["fused"]["median_us"])
    assert doc["rows"][0]["compare"]["graphs"] is True  # M=1: the fused decode kernels, captured
