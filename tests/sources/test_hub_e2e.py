"""The real huggingface_hub client against the loopback Hub (tests/hub_server.py) serving a synthesized checkpoint.

Every test passes endpoint= and cache_dir= explicitly, so nothing reaches the real Hub or the user's cache.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest

from hub_server import HubServer
from helpers import without_hint
from trellis_cli.cli.exit_codes import exit_code
from trellis_cli.errors import EXIT_SOURCE, SourceUnavailable
from trellis_cli.header import read_local_header
from trellis_cli.integrity import MISMATCH, NOT_CACHED, OK, verify_checksums
from trellis_cli.selection import fetch_files, parse_layer_ranges
from trellis_cli.sources import HEADER_WINDOW, HubSource, open_source
from trellis_cli.synth import preset, shard_name, write_checkpoint

REPO = "org/tiny-tr3"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("served") / "tiny", preset("tiny"))


@pytest.fixture
def hub(checkpoint):
    with HubServer() as server:
        server.main_sha = server.add_commit(REPO, checkpoint, tags=("v1",))
        yield server


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hub-cache"


def open_hub(hub: HubServer, cache: Path, spec: str = REPO, **kwargs) -> HubSource:
    source = open_source(spec, endpoint=hub.endpoint, cache_dir=cache, **kwargs)
    assert isinstance(source, HubSource)
    return source


def shards(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.glob("model-layer-*.safetensors"))


def resolve_paths(hub: HubServer) -> list[str]:
    return [path for method, path, _, _ in hub.requests if "/resolve/" in path]


# ---- revision pinning --------------------------------------------------------------------------------

def test_branch_resolves_once_and_reads_stay_on_that_commit(hub, cache, checkpoint, tmp_path):
    source = open_hub(hub, cache)
    assert source.revision == hub.main_sha
    assert source.describe() == {"kind": "hub", "repo_id": REPO, "requested_revision": "main",
                                 "revision": hub.main_sha, "endpoint": hub.endpoint, "offline": False,
                                 "listing_complete": True}
    assert source.description == f"hub {REPO}@{hub.main_sha}"

    # Move main to a new commit whose config differs: the open source must not notice.
    moved = tmp_path / "moved"
    shutil.copytree(checkpoint, moved)
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps({**config, "moved": True}))
    new_sha = hub.add_commit(REPO, moved)
    hub.reset_counters()

    assert "moved" not in source.read_json("config.json")
    source.read_header(shards(checkpoint)[0])
    assert resolve_paths(hub) and all(f"/resolve/{hub.main_sha}/" in p for p in resolve_paths(hub))
    assert open_hub(hub, cache).revision == new_sha
    assert open_hub(hub, cache).read_json("config.json")["moved"] is True


@pytest.mark.parametrize("form", ["tag", "sha", "hf-uri", "option"])
def test_tags_shas_and_uri_forms_pin_the_same_commit(hub, cache, form):
    spec, kwargs = {
        "tag": (f"{REPO}@v1", {}),
        "sha": (f"{REPO}@{hub.main_sha}", {}),
        "hf-uri": (f"hf://{REPO}@v1", {}),
        "option": (REPO, {"revision": "v1"}),
    }[form]
    source = open_hub(hub, cache, spec, **kwargs)
    assert source.revision == hub.main_sha
    assert source.describe()["requested_revision"] in ("v1", hub.main_sha)


# ---- header-only reads and listing -------------------------------------------------------------------

def test_listing_has_sizes_from_one_metadata_call(hub, cache, checkpoint):
    source = open_hub(hub, cache)
    expected = {p.name: p.stat().st_size for p in checkpoint.iterdir()}
    assert source.list_files() == expected
    api_calls = [p for _, p, _, _ in hub.requests if p.startswith("/api/")]
    assert len(api_calls) <= 2  # resolve the revision, then one listing with sizes and LFS hashes


def resolve_gets(hub: HubServer, name: str) -> int:
    """GETs of one file's resolve URL: one per round trip (each may be followed by the redirect to its blob)."""
    return sum(1 for method, path, _, _ in hub.requests if method == "GET" and path.endswith(f"/resolve/{hub.main_sha}/{name}"))


def test_header_reads_cost_one_ranged_get_per_file_within_the_window(hub, cache, checkpoint):
    source = open_hub(hub, cache)
    names = sorted(n for n in source.list_files() if n.endswith(".safetensors"))
    hub.reset_counters()
    source.prefetch_headers(names)
    largest = 0
    for i, name in enumerate(names):
        remote = source.read_header(name)
        local = read_local_header(checkpoint / name, name)
        assert remote == local
        assert resolve_gets(hub, name) == 1  # one round trip per file beyond the listing
        size = (checkpoint / name).stat().st_size
        window = min(size, HEADER_WINDOW.first if i == 0 else largest * 5 // 4 + HEADER_WINDOW.margin)
        # what a read transfers beyond the header is at most its window
        assert 8 + local.header_len <= hub.bytes_served[(REPO, name)] <= max(window, 8 + local.header_len)
        largest = max(largest, local.header_len)
    assert not [p for _, p, _, _ in hub.requests if p.startswith("/api/")]  # no metadata call per file
    assert not (cache / f"models--{REPO.replace('/', '--')}" / "blobs").exists()  # nothing downloaded


def test_a_header_longer_than_the_window_costs_a_second_get_of_its_rest(tmp_path, cache):
    """The first file's header is short, so its sibling's window is sized from it and falls short."""
    import torch
    from safetensors.torch import save_file

    repo = tmp_path / "repo"
    repo.mkdir()
    save_file({"w": torch.zeros(4)}, str(repo / "a.safetensors"))
    many = {f"model.layers.{i // 100}.mlp.experts.{i % 100}.down_proj.trellis": torch.zeros(1) for i in range(3000)}
    save_file(many, str(repo / "b.safetensors"))
    with HubServer() as hub:
        hub.main_sha = hub.add_commit(REPO, repo)
        source = open_hub(hub, cache)
        hub.reset_counters()
        source.prefetch_headers(["a.safetensors", "b.safetensors"])
        for name in ("a.safetensors", "b.safetensors"):
            assert source.read_header(name) == read_local_header(repo / name, name)
        a = read_local_header(repo / "a.safetensors", "a.safetensors")
        b = read_local_header(repo / "b.safetensors", "b.safetensors")
        assert 8 + b.header_len > a.header_len * 5 // 4 + HEADER_WINDOW.margin  # the guess from a's header is short
        assert resolve_gets(hub, "a.safetensors") == 1
        assert resolve_gets(hub, "b.safetensors") == 2
        assert hub.bytes_served[(REPO, "b.safetensors")] == 8 + b.header_len  # the rest, exactly


def test_short_files_and_lying_lengths_are_findings_not_network_errors(tmp_path, cache):
    import struct

    from trellis_cli.errors import CheckFailed

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "empty.safetensors").write_bytes(b"")
    (repo / "short.safetensors").write_bytes(b"\x01\x02\x03")
    (repo / "long.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")  # a header past the file's end
    with HubServer() as hub:
        hub.main_sha = hub.add_commit(REPO, repo)
        source = open_hub(hub, cache)
        for name, reason in (("empty.safetensors", "0 bytes"), ("short.safetensors", "3 bytes"),
                             ("long.safetensors", "header length 1000000 runs past the end of the 10-byte file")):
            with pytest.raises(CheckFailed, match=reason):
                source.read_header(name)
        assert resolve_gets(hub, "empty.safetensors") == 0


def test_a_server_that_ignores_ranges_is_refused_not_read_whole(hub, cache, checkpoint):
    source = open_hub(hub, cache)
    hub.honour_ranges = False
    name = shards(checkpoint)[0]
    with pytest.raises(SourceUnavailable, match="ignored the byte-range request"):
        source.read_header(name)


def test_missing_file_is_source_unavailable(hub, cache):
    source = open_hub(hub, cache)
    with pytest.raises(SourceUnavailable, match="nope.json: no such file"):
        source.read_json("nope.json")


# ---- selective download ------------------------------------------------------------------------------

def test_selective_download_fetches_only_the_chosen_layers(hub, cache, checkpoint):
    source = open_hub(hub, cache)
    hub.reset_counters()
    wanted = [shard_name(layer) for layer in parse_layer_ranges("3")]
    received: list[int] = []
    snapshot = fetch_files(source, wanted, progress=received.append)

    assert snapshot.name == hub.main_sha
    assert sorted(p.name for p in snapshot.iterdir()) == wanted
    assert (snapshot / wanted[0]).read_bytes() == (checkpoint / wanted[0]).read_bytes()
    assert sum(received) == (checkpoint / wanted[0]).stat().st_size
    other = [n for n in shards(checkpoint) if n not in wanted]
    assert other and all(hub.bytes_served.get((REPO, n), 0) == 0 for n in other)

    hub.reset_counters()  # a second fetch is served from the cache
    assert fetch_files(source, wanted) == snapshot
    assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0


# ---- checksums ---------------------------------------------------------------------------------------

def test_checksum_mismatch_against_the_hub_lfs_hash(hub, cache, checkpoint):
    good, bad = shards(checkpoint)
    hub.corrupt(REPO, hub.main_sha, bad)  # served bytes change; the listed sha256 stays the original
    source = open_hub(hub, cache)
    hashed: list[int] = []
    results = {r.file: r for r in verify_checksums(source, [good, bad, "config.json"], progress=hashed.append)}
    assert results[good].status == OK
    assert results["config.json"].status == OK  # non-LFS: git blob sha1
    assert results[bad].status == MISMATCH
    assert results[bad].expected == hashlib.sha256((checkpoint / bad).read_bytes()).hexdigest()
    assert results[bad].found != results[bad].expected
    assert sum(hashed) == sum(source.list_files()[n] for n in (good, bad, "config.json"))


def test_checksums_without_download_report_uncached_files(hub, cache, checkpoint):
    source = open_hub(hub, cache)
    results = verify_checksums(source, shards(checkpoint), download=False)
    assert {r.status for r in results} == {NOT_CACHED}
    assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0


# ---- errors ------------------------------------------------------------------------------------------

def test_missing_repo_is_exit_3_with_a_hint(hub, cache):
    with pytest.raises(SourceUnavailable) as info:
        open_hub(hub, cache, "org/does-not-exist")
    message = str(info.value)
    assert exit_code(info.value) == EXIT_SOURCE
    assert "org/does-not-exist" in message and "not found" in message and "HF_TOKEN" in message
    assert "\n" not in message


def test_bad_revision_is_exit_3_naming_the_revision(hub, cache):
    with pytest.raises(SourceUnavailable, match="revision 'no-such-branch' not found") as info:
        open_hub(hub, cache, revision="no-such-branch")
    assert exit_code(info.value) == EXIT_SOURCE


def test_private_repo_needs_the_token(hub, cache, checkpoint):
    hub.add_commit("org/private", checkpoint, private=True)
    with pytest.raises(SourceUnavailable) as info:
        open_hub(hub, cache, "org/private", token=False)
    assert "org/private" in str(info.value) and "hf auth login" in str(info.value)
    wrong = "hf_wrong_token_value"
    with pytest.raises(SourceUnavailable) as info:
        open_hub(hub, cache, "org/private", token=wrong)
    assert wrong not in str(info.value) and hub.token not in str(info.value)
    source = open_hub(hub, cache, "org/private", token=hub.token)
    assert source.read_header(shards(checkpoint)[0]).tensors
    assert source.read_json("config.json")


def test_gated_repo_says_so(hub, cache, checkpoint):
    hub.add_commit("org/gated", checkpoint, gated=True)
    with pytest.raises(SourceUnavailable, match="org/gated is gated: request access") as info:
        open_hub(hub, cache, "org/gated", token=False)
    assert exit_code(info.value) == EXIT_SOURCE
    assert open_hub(hub, cache, "org/gated", token=hub.token).revision


def test_unreachable_endpoint_is_exit_3(cache):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SourceUnavailable, match="cannot reach") as info:
        open_source(REPO, endpoint=f"http://127.0.0.1:{port}", cache_dir=cache)
    assert "--offline" in str(info.value)


# ---- offline mode and the cache ----------------------------------------------------------------------

def test_offline_without_cache_is_exit_3(hub, cache):
    with pytest.raises(SourceUnavailable, match="not in the local Hub cache") as info:
        open_hub(hub, cache, offline=True)
    assert exit_code(info.value) == EXIT_SOURCE
    assert hub.requests == []


def test_offline_reads_what_an_online_run_cached(hub, cache, checkpoint):
    first, second = shards(checkpoint)
    online = open_hub(hub, cache)
    online.read_json("config.json")
    fetch_files(online, [first])
    hub.reset_counters()

    offline = open_hub(hub, cache, offline=True)
    assert offline.revision == hub.main_sha
    assert offline.describe()["offline"] is True and offline.listing_complete is False
    assert set(offline.list_files()) == {"config.json", first}
    assert offline.read_json("config.json") == json.loads((checkpoint / "config.json").read_text())
    assert offline.read_header(first) == read_local_header(checkpoint / first, first)
    assert [r.status for r in verify_checksums(offline)] == [OK, OK]
    with pytest.raises(SourceUnavailable, match="not in the local Hub cache"):
        offline.local_path(second)
    assert open_hub(hub, cache, f"{REPO}@{hub.main_sha}", offline=True).revision == hub.main_sha
    assert hub.requests == []


def test_hf_hub_offline_setting_is_honoured(hub, cache, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1 at import
    with pytest.raises(SourceUnavailable, match="offline mode is on"):
        open_hub(hub, cache)
    assert hub.requests == []


def test_prefetched_headers_match_and_send_no_tensor_bytes(hub, cache, checkpoint):
    source = open_hub(hub, cache)
    names = shards(checkpoint)
    source.prefetch_headers(names + ["missing.safetensors"])
    assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0
    hub.reset_counters()
    for name in names:
        assert source.read_header(name) == read_local_header(checkpoint / name, name)
    assert hub.requests == []  # answered from memory
    with pytest.raises(SourceUnavailable, match="missing.safetensors"):
        source.read_header("missing.safetensors")


def test_environment_variables_configure_a_fresh_process(hub, tmp_path):
    """HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE are read at import: check them in a new interpreter."""
    import os
    import subprocess
    import sys

    script = (
        "from trellis_cli.sources import open_source\n"
        "s = open_source('%s')\n"
        "s.read_json('config.json')\n"
        "print(s.revision, s.offline)\n" % REPO
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "env-cache"), HF_HOME=str(tmp_path / "home"))

    def run(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script], env={**env, **extra}, capture_output=True,
                              text=True, timeout=60)

    online = run()
    assert online.returncode == 0, online.stderr
    assert online.stdout.split() == [hub.main_sha, "False"]
    hub.reset_counters()
    offline = run(HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout.split() == [hub.main_sha, "True"]
    assert hub.requests == []


# ---- the CLI through the loopback Hub (a fresh process: HF_* variables are read at import) ----------

@pytest.fixture
def trellis(hub, tmp_path):
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    base.update(HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "cli-cache"), HF_HOME=str(tmp_path / "home"),
                HF_HUB_DISABLE_PROGRESS_BARS="1")

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-m", "trellis_cli", *args], env={**base, **env},
                                capture_output=True, text=True, timeout=120)
        assert "Traceback" not in result.stderr, result.stderr
        return result

    return run


def test_cli_inspect_pins_the_revision_and_reads_headers_only(hub, trellis):
    result = trellis("inspect", REPO, "--revision", "main", "--json")
    assert result.returncode == 0, result.stderr
    source = json.loads(result.stdout)["source"]
    assert source["revision"] == hub.main_sha and source["requested_revision"] == "main"
    assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0


def test_cli_validate_passes_header_only(hub, trellis):
    result = trellis("validate", REPO)
    assert result.returncode == 0, result.stderr
    assert "PASS" in result.stdout and hub.main_sha in result.stdout
    assert hub.tensor_bytes_past_window(HEADER_WINDOW) == 0


@pytest.mark.parametrize("args, expected", [
    (("validate", "org/does-not-exist"), "org/does-not-exist: repository not found"),
    (("validate", REPO, "--revision", "nope"), "revision 'nope' not found"),
    (("inspect", "org/private"), "org/private: access denied (401)"),
])
def test_cli_unreachable_sources_exit_3_with_one_line(hub, trellis, checkpoint, args, expected):
    hub.add_commit("org/private", checkpoint, private=True)
    result = trellis(*args)
    assert result.returncode == EXIT_SOURCE
    lines = without_hint(result.stderr).strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("error:")


def test_cli_private_repo_with_hf_token(hub, trellis, checkpoint):
    hub.add_commit("org/private", checkpoint, private=True)
    result = trellis("validate", "org/private", HF_TOKEN=hub.token)
    assert result.returncode == 0, result.stderr
    assert hub.token not in result.stdout + result.stderr


def test_cli_checksum_mismatch_fails_validation(hub, trellis, checkpoint):
    hub.corrupt(REPO, hub.main_sha, shards(checkpoint)[1])
    result = trellis("validate", REPO, "--checksums", "--json")
    assert result.returncode == 1
    findings = json.loads(result.stdout)["findings"]
    assert [f["location"]["file"] for f in findings if f["code"] == "checksum.mismatch"] == [shards(checkpoint)[1]]


@pytest.mark.slow
def test_cli_offline_uses_what_an_online_run_cached(hub, trellis):
    assert trellis("validate", REPO, HF_HUB_OFFLINE="1").returncode == EXIT_SOURCE  # nothing cached yet
    assert trellis("validate", REPO, "--checksums").returncode == 0  # downloads every file
    hub.reset_counters()
    result = trellis("validate", REPO, HF_HUB_OFFLINE="1")
    assert result.returncode == 0, result.stderr
    assert hub.main_sha in result.stdout and hub.requests == []
