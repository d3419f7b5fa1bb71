"""Hostile checkpoint directories: links that leave or loop, special files, unreadable files, hostile JSON,
malformed checksum manifests, wrong JSON types and declared counts far above what the files hold.

Each case damages a fresh copy of the `tiny` synth checkpoint and asserts the exit code, the finding code
and that the message names the file; none may raise, hang or read outside the directory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from corrupt import INDEX, SHARD3, edit_json, key, rewrite_header
from helpers import run_cli, tiny_checkpoint
from trellis_cli.header import HeaderError, parse_header
from trellis_cli.integrity import CHECKSUM_MANIFEST, MALFORMED, OK, UNSAFE_PATH, verify_checksums
from trellis_cli.sources import LocalSource

REPO = Path(__file__).resolve().parents[2]
DEEP_JSON = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("base"))


@pytest.fixture
def ckpt(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ckpt", symlinks=True))


def findings(root: Path, capsys, *flags: str) -> tuple[int, list[dict]]:
    code, out, _ = run_cli(capsys, "validate", str(root), "--json", *flags)
    return code, json.loads(out)["findings"]


def named(found: list[dict], code: str, file: str) -> list[dict]:
    return [f for f in found if f["code"] == code and f["location"].get("file") == file]


# ---- MANIFEST.sha256 -----------------------------------------------------------------------------------

def test_manifest_linking_outside_is_refused_unread(ckpt, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:SECRET-LINE\n")
    (ckpt / CHECKSUM_MANIFEST).unlink()
    os.symlink(secret, ckpt / CHECKSUM_MANIFEST)
    results = verify_checksums(LocalSource(ckpt))
    assert (CHECKSUM_MANIFEST, UNSAFE_PATH) in [(r.file, r.status) for r in results]
    code, out, err = run_cli(capsys, "validate", str(ckpt), "--checksums")
    assert code == 1 and "SECRET" not in out + err
    assert f"error[path.escape] {CHECKSUM_MANIFEST}: the manifest is a link" in out


def test_malformed_and_non_utf8_manifest_lines_are_findings_and_the_rest_is_checked(ckpt, capsys):
    first = len((ckpt / CHECKSUM_MANIFEST).read_text().splitlines()) + 1  # the first line appended
    with open(ckpt / CHECKSUM_MANIFEST, "ab") as f:
        f.write(b"not-a-hash  config.json\n\xff\xfe  x\n")
    code, found = findings(ckpt, capsys, "--checksums")
    assert code == 1
    assert named(found, "checksum.manifest", f"{CHECKSUM_MANIFEST}:{first}")[0]["message"].startswith(
        "expected '<64 hex>")
    assert "not UTF-8" in named(found, "checksum.manifest", f"{CHECKSUM_MANIFEST}:{first + 1}")[0]["message"]
    assert not [f for f in found if f["code"].startswith("checksum.") and f["code"] != "checksum.manifest"]
    problems = [r for r in verify_checksums(LocalSource(ckpt), strict_manifest=False) if r.status != OK]
    assert [(r.file, r.status) for r in problems] == [(f"{CHECKSUM_MANIFEST}:{first}", MALFORMED),
                                                      (f"{CHECKSUM_MANIFEST}:{first + 1}", MALFORMED)]


# ---- symlink loops and NUL bytes ------------------------------------------------------------------------

def test_symlink_loops_are_dangling_findings(ckpt, capsys):
    os.symlink("b.safetensors", ckpt / "a.safetensors")
    os.symlink("a.safetensors", ckpt / "b.safetensors")
    os.symlink("loop.json", ckpt / "loop.json")
    code, found = findings(ckpt, capsys)
    assert code == 1
    for name in ("a.safetensors", "b.safetensors", "loop.json"):
        assert named(found, "path.dangling", name), name


def test_config_that_links_to_itself_is_unreadable(ckpt, capsys):
    (ckpt / "config.json").unlink()
    os.symlink("config.json", ckpt / "config.json")
    code, found = findings(ckpt, capsys)
    assert code == 1 and found[0]["code"] == "checkpoint.unreadable" and "config.json" in found[0]["message"]


def test_nul_byte_in_an_index_path_is_an_escape(ckpt, capsys):
    edit_json(ckpt / INDEX, lambda d: d["weight_map"].update({key(3, 0, "gate_proj", 0, "trellis"):
                                                              SHARD3 + "\u0000x"}))
    code, found = findings(ckpt, capsys)
    assert code == 1 and named(found, "path.escape", INDEX)


# ---- special files and unreadable directories ----------------------------------------------------------

@pytest.mark.parametrize("name,severity", [("x.safetensors", "error"), ("notes.txt", "warning")])
def test_fifos_are_never_opened(ckpt, capsys, name, severity):
    os.mkfifo(ckpt / name)
    source = LocalSource(ckpt)
    assert name not in source.list_files() and source.special == {name: "a FIFO"}
    code, found = findings(ckpt, capsys, "--checksums")  # would block forever if the FIFO were opened
    special = named(found, "path.special", name)
    assert special[0]["severity"] == severity and special[0]["found"] == "a FIFO"
    assert code == (1 if severity == "error" else 0)


def test_fifo_config_is_unreadable_not_unknown(ckpt, capsys):
    (ckpt / "config.json").unlink()
    os.mkfifo(ckpt / "config.json")
    code, found = findings(ckpt, capsys)
    assert code == 1 and found[0]["code"] == "checkpoint.unreadable" and "a FIFO" in found[0]["message"]


# Root can read anything: the permission cases run under capsh without the DAC capabilities.
_AS_USER = """
import json, sys
from trellis_cli.dialects import open_checkpoint
from trellis_cli.errors import TrellisError
from trellis_cli.validate import run_validation
out = {}
for root in sys.argv[1:]:
    try:
        out[root] = [[f.code, f.where.file, f.message] for f in run_validation(open_checkpoint(root), checksums=True).findings]
    except TrellisError as e:
        out[root] = [[type(e).__name__, None, str(e)]]
print(json.dumps(out))
"""


def _run_without_dac(roots: list[Path]) -> dict[str, list]:
    if os.geteuid() != 0:
        argv = [sys.executable, "-c", _AS_USER, *map(str, roots)]
    elif shutil.which("capsh"):
        script = " ".join(["exec", sys.executable, "-c", _shell_quote(_AS_USER), *map(str, roots)])
        argv = ["capsh", "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", script]
    else:
        pytest.skip("running as root without capsh: permissions cannot be denied")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _shell_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def test_unreadable_files_and_root_are_named(base, tmp_path):
    cases = {"config.json": "checkpoint", SHARD3: "file.unreadable", "tier_bitmap.json": "bitmap.unreadable",
             INDEX: "json.unreadable", CHECKSUM_MANIFEST: "file.unreadable"}
    roots = []
    for i, name in enumerate(cases):
        root = Path(shutil.copytree(base, tmp_path / f"c{i}"))
        (root / name).chmod(0)
        roots.append(root)
    locked = Path(shutil.copytree(base, tmp_path / "locked"))
    locked.chmod(0)
    try:
        result = _run_without_dac([*roots, locked])
    finally:
        locked.chmod(0o755)
    for root, (name, code) in zip(roots, cases.items()):
        got = result[str(root)]
        if code == "checkpoint":  # config.json: nothing else can be trusted (validate: checkpoint.unreadable)
            assert got == [["CheckFailed", None, f"{name}: cannot read the file (Permission denied)"]], got
            continue
        assert [code, name, "cannot read the file (Permission denied)"] in got, (name, got)
    assert result[str(locked)] == [["SourceUnavailable", None,
                                    f"{locked}: cannot list the directory (Permission denied)"]]


# ---- hostile JSON -------------------------------------------------------------------------------------

def _replace_header(path: Path, body: bytes) -> None:
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n:])


@pytest.mark.parametrize("name", ["config.json", INDEX, "tier_bitmap.json", SHARD3])
def test_deeply_nested_json_is_named_not_a_recursion_error(ckpt, capsys, name):
    if name.endswith(".safetensors"):
        _replace_header(ckpt / name, DEEP_JSON.encode())
    else:
        (ckpt / name).write_text(DEEP_JSON)
    code, out, err = run_cli(capsys, "validate", str(ckpt))
    assert code == 1 and "Traceback" not in err
    assert f"{name}" in out and "invalid JSON (nested too deeply)" in out


def test_lone_surrogate_in_a_tensor_name_is_a_header_finding(ckpt, capsys):
    evil = key(3, 0, "gate_proj", 0, "suh")

    def mutate(header: dict) -> None:
        header["evil\ud800name"] = header.pop(evil)

    rewrite_header(ckpt / SHARD3, mutate)  # json.dumps writes the lone surrogate as the escape \ud800
    code, found = findings(ckpt, capsys)
    header = named(found, "file.header", SHARD3)
    assert code == 1 and "lone surrogate \\ud800" in header[0]["message"]
    with pytest.raises(HeaderError, match="not valid Unicode"):
        body = b'{"__metadata__": {"k": "\\udc00"}}'
        parse_header("x.safetensors", body, len(body), None)


def test_valid_surrogate_pairs_are_accepted():
    body = json.dumps({"__metadata__": {"note": "\U0001F600"}}).encode()  # escaped as a surrogate pair
    assert parse_header("x.safetensors", body, len(body), None).metadata == {"note": "\U0001F600"}


# ---- wrong JSON types, empty tensors ------------------------------------------------------------------

def test_quantization_config_that_is_a_list_is_a_named_warning(ckpt, capsys):
    edit_json(ckpt / "config.json", lambda c: c.pop("hybrid_tr3_tail"))
    (ckpt / "quantization_config.json").write_text("[]")
    code, found = findings(ckpt, capsys)
    bad = named(found, "json.unreadable", "quantization_config.json")
    assert bad[0]["severity"] == "warning" and (bad[0]["expected"], bad[0]["found"]) == ("object", "list")
    # Without hybrid_tr3_tail this is plain EXL3 with rank-sliced names, which exllamav3 (its default engine)
    # cannot load: that is the one error.
    assert code == 1 and {f["code"] for f in found if f["severity"] == "error"} == {"engine.container"}


def test_deep_on_a_zero_row_trellis_reports_instead_of_crashing(ckpt, capsys):
    name = key(3, 0, "gate_proj", 0, "trellis")

    def mutate(header: dict) -> None:
        header[name].update(shape=[0, 8, 48], data_offsets=[0, 0])

    rewrite_header(ckpt / SHARD3, mutate)
    code, found = findings(ckpt, capsys, "--deep")
    geometry = [f for f in found if f["code"] == "tensor.geometry" and f["location"].get("tensor") == name]
    assert code == 1 and geometry[0]["found"] == [0, 8]


# ---- declared counts far above what the files hold ----------------------------------------------------

def _declare(root: Path, **values) -> None:
    edit_json(root / "config.json", lambda c: c["hybrid_tr3_tail"].update(values))


@pytest.mark.parametrize("field,value,count", [
    ("tp", 1_000_000, 1_000_000),
    ("experts_per_layer", 100_000_000, 100_000_000),
    ("moe_layers", [3, 1_000_000_000], 999_999_998),
])
def test_huge_declared_counts_are_one_finding(ckpt, capsys, field, value, count):
    _declare(ckpt, **{field: value})
    code, found = findings(ckpt, capsys)
    implausible = [f for f in found if f["code"] == "count.implausible"]
    assert code == 1 and len(implausible) == 1 and len(found) < 10, found
    assert implausible[0]["location"] == {"file": "config.json", "tensor": f"hybrid_tr3_tail.{field}"}
    assert implausible[0]["found"] == count
    assert run_cli(capsys, "inspect", str(ckpt))[0] in (0, 1)  # returns: no per-layer objects for a billion layers


@pytest.mark.parametrize("old,new,code", [
    ("experts.0.", "experts.99999999999.", "expert.extra"),
    (".rank1.", ".rank999999999.", "rank.extra"),
])
def test_huge_ids_in_plain_exl3_names_are_one_finding(ckpt, capsys, old, new, code):
    edit_json(ckpt / "config.json", lambda c: (c.pop("hybrid_tr3_tail"), c.pop("n_routed_experts")))
    name = key(3, 0, "gate_proj", 1, "trellis")

    def mutate(header: dict) -> None:
        header.pop("__metadata__", None)  # room for the longer name
        header[name.replace(old, new)] = header.pop(name)

    rewrite_header(ckpt / SHARD3, mutate)
    status, found = findings(ckpt, capsys)
    implausible = [f for f in found if f["code"] == "count.implausible"]
    assert status == 1 and len(implausible) == 1 and len(found) < 20, found
    assert implausible[0]["location"] == {"tensor": name.replace(old, new).rsplit(".", 1)[0]}
    assert [f for f in found if f["code"] == code]


def test_missing_items_are_capped_per_layer_with_a_total(ckpt, capsys):
    _declare(ckpt, experts_per_layer=4000, tp=300)  # within the limit, so checked item by item
    edit_json(ckpt / "config.json", lambda c: c.update(n_routed_experts=4000))
    code, found = findings(ckpt, capsys)
    experts = [f for f in found if f["code"] == "expert.missing" and f["location"] == {"layer": 3}]
    ranks = [f for f in found if f["code"] == "rank.missing" and f["location"] == {"layer": 3}]
    assert code == 1 and "3942 more missing experts" in experts[0]["message"]  # 4000 - 8 present - 50 shown
    assert ranks and ranks[0]["found"] == f"{8 * 3 * 298} missing"
    assert len(found) < 400
