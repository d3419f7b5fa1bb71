"""Hostile checkpoints that validate once passed but a loader, or safetensors itself, refuses: headers
safetensors refuses, a header of too many tensors, names and bitmap keys that only look canonical, layers
outside what the config declares, model config fields of the wrong type, subnormal vectors under --deep; and
a checksum manifest that `sha256sum -c` accepts but validate refused.

Each case damages a fresh copy of the `tiny` synth checkpoint and runs `trellis validate` in-process; the
safetensors cases also open the damaged file with the real `safetensors` library and the manifest cases run
the real `sha256sum`, so the tests state what those refuse rather than what we believe they refuse.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from corrupt import INDEX, SHARD3, edit_json, key, write_tensor_bytes
from helpers import tiny_checkpoint as synth
from helpers import run_cli
from trellis_cli.header_records import MAX_HEADER_TENSORS
from trellis_cli.integrity import CHECKSUM_MANIFEST


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("base"))


@pytest.fixture
def ckpt(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ckpt", symlinks=True))


def validate(capsys, root: Path, *flags: str) -> tuple[int, list[dict]]:
    code, out, _ = run_cli(capsys, "validate", str(root), "--json", *flags)
    return code, json.loads(out)["findings"]


def codes(found: list[dict]) -> set[str]:
    return {f["code"] for f in found}


# ---- MANIFEST.sha256 as sha256sum writes and reads it -------------------------------------------------

ODD_NAMES = ("notes ", " lead.txt", "tab\there.txt", "new\nline.txt")


def _sha256sum(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sha256sum", *args], cwd=root, capture_output=True, timeout=60)


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils sha256sum")
def test_manifest_written_by_sha256sum_is_read_as_sha256sum_reads_it(ckpt, capsys):
    for i, name in enumerate(ODD_NAMES):
        (ckpt / name).write_bytes(b"odd %d\n" % i)
    names = sorted(p.name for p in ckpt.iterdir() if p.name != CHECKSUM_MANIFEST)
    text = _sha256sum(ckpt, "--", *names[:3]).stdout  # text mode: two spaces
    text += _sha256sum(ckpt, "-b", "--", *names[3:-1]).stdout  # binary mode: " *"; escaped names start "\"
    text += _sha256sum(ckpt, "--tag", "--", names[-1]).stdout  # BSD tagged form
    (ckpt / CHECKSUM_MANIFEST).write_bytes(text.replace(b"\n", b"\r\n", 1))  # one CRLF line, as a Windows editor saves
    assert _sha256sum(ckpt, "-c", "--strict", CHECKSUM_MANIFEST).returncode == 0
    code, found = validate(capsys, ckpt, "--checksums")
    assert code == 0 and not [f for f in found if f["code"].startswith("checksum.")], found

    (ckpt / "notes ").write_bytes(b"changed\n")  # the name with the trailing space is the one hashed
    assert _sha256sum(ckpt, "-c", CHECKSUM_MANIFEST).returncode == 1
    code, found = validate(capsys, ckpt, "--checksums")
    assert code == 1 and [f["location"] for f in found if f["code"] == "checksum.mismatch"] == [{"file": "notes "}]


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils sha256sum")
@pytest.mark.parametrize("line", [
    "\\{h}  bad\\qescape",  # only \\, \n and \r may be escaped
    "{h}",  # no name
    "{h}**x",  # no blank after the hash
    "{h} x",  # the reversed form after lines of the two-space form
])
def test_lines_sha256sum_refuses_are_malformed(ckpt, capsys, line):
    appended = len((ckpt / CHECKSUM_MANIFEST).read_text().splitlines()) + 1
    with open(ckpt / CHECKSUM_MANIFEST, "a") as f:
        f.write(line.format(h="0" * 64) + "\n")
    assert b"1 line is improperly formatted" in _sha256sum(ckpt, "-c", CHECKSUM_MANIFEST).stderr
    code, found = validate(capsys, ckpt, "--checksums")
    assert code == 1 and [f["location"] for f in found if f["code"] == "checksum.manifest"] == [
        {"file": f"{CHECKSUM_MANIFEST}:{appended}"}]


# ---- headers safetensors refuses ----------------------------------------------------------------------

def _set_header(path: Path, edit) -> None:
    """Rewrite the header JSON (text edits: JSON numbers Python would not write), keeping the data in place."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    body = edit(data[8:8 + n].decode()).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + n:])


def _refused_by_safetensors(path: Path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                f.get_tensor(name)
    except Exception:  # SafetensorError, or torch refusing a dimension above int64
        return True
    return False


ZERO_SIZE = '"model.extra.weight":{"dtype":"%s","shape":%s,"data_offsets":[0,0]}'


@pytest.mark.parametrize("edit,reason", [
    (lambda h: h.replace('"__metadata__":{"format":"pt"}', '"__metadata__":false'), "__metadata__ must map"),
    (lambda h: h.replace('"__metadata__":{"format":"pt"}', '"__metadata__":0'), "__metadata__ must map"),
    (lambda h: h.replace('"__metadata__":{"format":"pt"}', '"__metadata__":""'), "__metadata__ must map"),
    (lambda h: h.replace('"__metadata__":{"format":"pt"}', '"__metadata__":[]'), "__metadata__ must map"),
    (lambda h: h.replace('"__metadata__":{"format":"pt"}', '"__metadata__":{"format":1}'), "__metadata__ must map"),
    (lambda h: h[:-1] + "," + ZERO_SIZE % ("U8", "[18446744073709551616,0]") + "}", "shape must be"),
    (lambda h: h[:-1] + "," + ZERO_SIZE % ("U8", "[9223372036854775808,0]") + "}", "shape must be"),
    (lambda h: h[:-1] + "," + ZERO_SIZE % ("F16", "[4294967296,4294967296,0]") + "}", "overflows a 64-bit size"),
    (lambda h: h[:-1] + "," + ZERO_SIZE % ("U8", "[-0]") + "}", "shape must be"),
    (lambda h: h[:-1] + ',"model.extra.weight":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":NaN}}',
     "NaN is not a JSON number"),
], ids=["metadata-false", "metadata-0", "metadata-empty-string", "metadata-list", "metadata-int-value",
        "dim-2^64", "dim-2^63", "product-overflow-before-zero", "minus-zero", "nan"])
def test_headers_safetensors_refuses_are_refused(ckpt, capsys, edit, reason):
    shard = ckpt / SHARD3
    _set_header(shard, lambda h: edit(h.rstrip()))
    assert _refused_by_safetensors(shard)
    code, found = validate(capsys, ckpt)
    header = [f for f in found if f["code"] == "file.header" and f["location"] == {"file": SHARD3}]
    assert code == 1 and header and reason in header[0]["message"], found


def test_zero_dimension_first_is_accepted_like_safetensors(ckpt, capsys):
    # [0, 2^32, 2^32]: the running product is 0 before it could overflow; safetensors and torch load it.
    shard = ckpt / SHARD3
    _set_header(shard, lambda h: h.rstrip()[:-1] + "," + ZERO_SIZE % ("F16", "[0,4294967296,4294967296]") + "}")
    assert not _refused_by_safetensors(shard)
    code, found = validate(capsys, ckpt)
    assert "file.header" not in codes(found)


# ---- the work per header is bounded ---------------------------------------------------------------------

def test_a_header_of_too_many_tensors_is_refused_before_it_is_parsed(ckpt, capsys):
    entries = ",".join('"t.%d":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}' % i
                       for i in range(MAX_HEADER_TENSORS + 1))
    body = ("{" + entries + "}").encode()
    (ckpt / "model-extra.safetensors").write_bytes(struct.pack("<Q", len(body)) + body)
    started = time.monotonic()
    code, found = validate(capsys, ckpt)
    elapsed = time.monotonic() - started
    limit = [f for f in found if f["code"] == "file.too-many-tensors"]
    assert code == 1 and limit[0]["location"] == {"file": "model-extra.safetensors"}, found
    assert f"{MAX_HEADER_TENSORS + 1} data_offsets fields" in limit[0]["message"]
    assert elapsed < 30  # the parse is skipped: well under a second where building the entries took seconds


# ---- names that only look right -------------------------------------------------------------------------

def _rename_tensor(root: Path, old: str, new: str) -> None:
    """Rename one tensor in its shard's header and in the index (so only the spelling differs)."""
    _set_header(root / SHARD3, lambda h: h.replace(json.dumps(old), json.dumps(new)))
    edit_json(root / INDEX, lambda d: d["weight_map"].update({new: d["weight_map"].pop(old)}))


TRELLIS = key(3, 7, "gate_proj", 1, "trellis")


@pytest.mark.parametrize("old,new,reason", [
    ("experts.7.", "experts.007.", "expert id '007' is not canonical"),
    ("layers.3.", "layers.03.", "layer id '03' is not canonical"),
    ("layers.3.", "layers.\u0663.", "layer id '\\u0663' is not canonical"),  # Arabic-Indic three
    ("experts.7.", "experts.\u0667.", "expert id '\\u0667' is not canonical"),  # Arabic-Indic seven
    (".rank1.", ".rank01.", "rank id '01' is not canonical"),
    ("experts.7.", "experts.\uff17.", "Unicode normalization"),  # full-width seven
    ("model.", "\uff4dodel.", "Unicode normalization"),  # full-width m
    ("model.", "foo.model.", "prefix 'foo.model.' is not 'model.'"),
], ids=["expert-007", "layer-03", "layer-arabic-indic", "expert-arabic-indic", "rank-01", "expert-full-width",
        "prefix-full-width", "foreign-prefix"])
def test_names_that_only_look_canonical_are_unrecognised_and_missing(ckpt, capsys, old, new, reason):
    _rename_tensor(ckpt, TRELLIS, TRELLIS.replace(old, new, 1))
    code, found = validate(capsys, ckpt)
    bad = [f for f in found if f["code"] == "tensor.noncanonical"]
    assert code == 1 and len(bad) == 1 and reason in bad[0]["message"], found
    assert bad[0]["location"] == {"file": SHARD3, "tensor": TRELLIS.replace(old, new, 1)}
    missing = [f for f in found if f["code"] == "tensor.missing"]
    assert [f["location"]["tensor"] for f in missing] == [TRELLIS], found


@pytest.mark.parametrize("spelling", ["03", "\u0663", "\uff13"])
def test_bitmap_keys_that_only_look_like_the_layer_leave_it_undeclared(ckpt, capsys, spelling):
    edit_json(ckpt / "tier_bitmap.json", lambda d: d.update({spelling: d.pop("3")}))
    code, found = validate(capsys, ckpt)
    assert code == 1 and [f["found"] for f in found if f["code"] == "bitmap.key"] == [spelling]
    assert [f["location"] for f in found if f["code"] == "bitmap.layer-missing"] == [
        {"file": "tier_bitmap.json", "layer": 3}]


def test_a_bitmap_key_that_shadows_an_earlier_one_is_refused(ckpt, capsys):
    bitmap = json.loads((ckpt / "tier_bitmap.json").read_text())
    decoy = json.dumps({"k": [4] * 8, "tail_tr3": list(range(8)), "keep_nvfp4": []})
    text = "{" + '"3": ' + decoy + ", " + json.dumps(bitmap)[1:]  # the real "3" comes second and wins in Python
    (ckpt / "tier_bitmap.json").write_text(text)
    code, found = validate(capsys, ckpt)
    bad = [f for f in found if f["code"] == "bitmap.unreadable"]
    assert code == 1 and "the key '3' appears twice" in bad[0]["message"], found


# ---- layers outside what the config declares ----------------------------------------------------------

def test_a_layer_in_the_files_outside_moe_layers_is_a_finding(ckpt, capsys):
    edit_json(ckpt / "config.json", lambda c: c["hybrid_tr3_tail"].update(moe_layers=[3, 3]))
    code, found = validate(capsys, ckpt)
    assert code == 1 and [(f["location"], f["found"]) for f in found if f["code"] == "layer.undeclared"] == [
        ({"layer": 4}, 4)], found


@pytest.mark.parametrize("last", [10**30, 2**63])
def test_an_absurd_moe_layers_bound_is_one_finding_not_an_internal_error(ckpt, capsys, last):
    edit_json(ckpt / "config.json", lambda c: c["hybrid_tr3_tail"].update(moe_layers=[3, last]))
    code, out, err = run_cli(capsys, "validate", str(ckpt), "--json")
    assert code == 1 and "internal error" not in err
    implausible = [f for f in json.loads(out)["findings"] if f["code"] == "count.implausible"]
    assert implausible[0]["location"] == {"file": "config.json", "tensor": "hybrid_tr3_tail.moe_layers"}
    assert implausible[0]["found"] == last - 2


# ---- the model config fields the serving engine reads -------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("hidden_size", "256"), ("hidden_size", 256.0), ("hidden_size", True), ("hidden_size", -256),
    ("moe_intermediate_size", 256.5), ("moe_intermediate_size", 0), ("n_routed_experts", "8"),
    ("n_routed_experts", True), ("num_experts_per_tok", 2.0), ("num_experts_per_tok", -2),
    ("num_hidden_layers", "5"), ("num_hidden_layers", None), ("num_nextn_predict_layers", -1),
])
def test_model_fields_of_the_wrong_type_are_findings(ckpt, capsys, field, value):
    edit_json(ckpt / "config.json", lambda c: c.update({field: value}))
    code, found = validate(capsys, ckpt)
    bad = [f for f in found if f["code"] == "config.model-field"]
    assert code == 1 and [f["location"] for f in bad] == [{"file": "config.json", "tensor": field}], found
    assert bad[0]["found"].startswith(type(value).__name__)


def test_top_k_above_the_expert_count_is_a_finding(ckpt, capsys):
    edit_json(ckpt / "config.json", lambda c: c.update(num_experts_per_tok=9))
    code, found = validate(capsys, ckpt)
    assert code == 1 and [(f["expected"], f["found"]) for f in found if f["code"] == "config.top-k"] == [
        ("<= 8", 9)], found


@pytest.mark.parametrize("changes,bad_layers", [
    ({"num_hidden_layers": 4}, [4]),  # layer 4 holds experts: the model has layers 0-3
    ({"num_hidden_layers": 3, "num_nextn_predict_layers": 1}, [4]),  # 0-2 and the MTP layer 3
    ({"num_hidden_layers": 4, "num_nextn_predict_layers": 1}, []),  # 0-3 and the MTP layer 4
])
def test_layers_beyond_the_model_depth_are_findings(ckpt, capsys, changes, bad_layers):
    edit_json(ckpt / "config.json", lambda c: c.update(changes))
    code, found = validate(capsys, ckpt)
    assert [f["found"] for f in found if f["code"] == "config.layer-count"] == bad_layers, found
    assert code == (1 if bad_layers else 0)


# ---- --deep: vectors that are as dead as zeros ----------------------------------------------------------

@pytest.mark.parametrize("word", [0x0001, 0x83FF], ids=["smallest-subnormal", "negative-largest-subnormal"])
def test_deep_flags_a_vector_of_subnormals(ckpt, capsys, word):
    name = key(3, 0, "gate_proj", 0, "suh")
    write_tensor_bytes(ckpt / SHARD3, name, struct.pack("<H", word) * 256)  # suh is F16 [256]
    code, found = validate(capsys, ckpt, "--deep")
    dead = [f for f in found if f["code"] == "data.subnormal-vector"]
    assert code == 1 and [f["location"]["tensor"] for f in dead] == [name], found
    assert "data.zero-vector" not in codes(found)
