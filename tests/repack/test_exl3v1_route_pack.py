"""repack exl3-v1 -> route pack: at each allowed --tp, --layers/--ranks, validated, verified, resumable, and
its way back to TR3 equal to the direct exl3-v1 -> TR3 conversion file for file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trellis_cli.dialects.exl3v1.synth import write_exl3v1_checkpoint
from helpers import Interrupted, interrupt_after
from helpers import run_cli_merged as run_cli
from helpers import exl3v1_specs, tensor_bytes


def file_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


SPECS = exl3v1_specs()


@pytest.mark.parametrize("tp", [1, 2])
def test_pack_validates_and_goes_back_to_the_same_tr3_as_the_direct_conversion(capsys, exl3, tmp_path, tp):
    code, text = run_cli(capsys, "repack", str(exl3), str(tmp_path / "pack"), "--tp", str(tp))
    assert code == 0, text
    assert sorted(p.name for p in (tmp_path / "pack").glob("layer-*")) == sorted(
        f"layer-{li:03d}-rank-{r}.safetensors" for li in (3, 4) if (exl3 / f"exl3-layer-{li:05d}.safetensors").exists()
        for r in range(tp))
    code, text = run_cli(capsys, "validate", str(tmp_path / "pack"), "--checksums")
    assert code == 0 and "PASS" in text, text
    assert run_cli(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "back"), "--to", "tr3")[0] == 0
    assert run_cli(capsys, "repack", str(exl3), str(tmp_path / "direct"), "--to", "tr3", "--tp", str(tp))[0] == 0
    assert tensor_bytes(tmp_path / "back") == tensor_bytes(tmp_path / "direct")
    assert file_bytes(tmp_path / "back") == file_bytes(tmp_path / "direct")  # config, bitmap, index, MANIFEST too


def test_pack_equals_the_route_pack_of_the_converted_tr3(capsys, exl3, tmp_path):
    """Two ways to a route pack: directly, and exl3-v1 -> TR3 -> route pack. Every layer file tensor agrees."""
    assert run_cli(capsys, "repack", str(exl3), str(tmp_path / "pack"), "--tp", "2")[0] == 0
    assert run_cli(capsys, "repack", str(exl3), str(tmp_path / "tr3"), "--to", "tr3", "--tp", "2")[0] == 0
    assert run_cli(capsys, "repack", str(tmp_path / "tr3"), str(tmp_path / "via"))[0] == 0
    direct, via = tensor_bytes(tmp_path / "pack", "layer-*"), tensor_bytes(tmp_path / "via", "layer-*")
    assert direct and direct == via
    manifest = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert manifest["source"]["dialect"] == "exl3-v1" and manifest["tp"] == 2
    assert manifest["layers"]["3"]["source_files"] == ["exl3-layer-00003.safetensors"]


def test_layers_and_ranks_select(capsys, tmp_path):
    source = write_exl3v1_checkpoint(tmp_path / "exl3", SPECS["pair-per-expert"])
    code, text = run_cli(capsys, "repack", str(source), str(tmp_path / "pack"), "--tp", "2", "--layers", "4",
                         "--ranks", "1")
    assert code == 0, text
    assert sorted(p.name for p in (tmp_path / "pack").glob("layer-*")) == ["layer-004-rank-1.safetensors"]
    assert run_cli(capsys, "validate", str(tmp_path / "pack"))[0] == 0
    manifest = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert manifest["ranks"] == [1] and list(manifest["layers"]) == ["4"]
    code, text = run_cli(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "back"), "--to", "tr3")
    assert code == 2 and "holds ranks [1] of 2" in text


@pytest.mark.parametrize("args, message", [
    (("--tp", "3"), "slot layout"),
    (("--shared-h",), "--shared-h does not apply"),
    (("--ranks", "2"), "--ranks: [2] not in the source"),
])
def test_refusals_write_nothing(capsys, tmp_path, args, message):
    source = write_exl3v1_checkpoint(tmp_path / "exl3", SPECS["uniform-shared"])
    code, text = run_cli(capsys, "repack", str(source), str(tmp_path / "pack"), "--tp", "2", *args)
    assert code == 2 and message in text, text
    assert not (tmp_path / "pack").exists() and not (tmp_path / "pack.partial").exists()


def test_route_pack_to_exl3v1_is_refused_by_name(capsys, tmp_path):
    source = write_exl3v1_checkpoint(tmp_path / "exl3", SPECS["uniform-shared"])
    assert run_cli(capsys, "repack", str(source), str(tmp_path / "pack"))[0] == 0
    code, text = run_cli(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "x"), "--to", "exl3-v1")
    assert code == 2 and "already a route pack" in text and not (tmp_path / "x").exists()


def test_interrupted_pack_resumes(tmp_path, monkeypatch):
    from trellis_cli import RepackOptions, run_repack

    source = write_exl3v1_checkpoint(tmp_path / "exl3", SPECS["pair-per-expert"])
    with monkeypatch.context() as patch, pytest.raises(Interrupted):
        interrupt_after(patch, 1)
        run_repack(str(source), tmp_path / "pack", RepackOptions(tp=2))
    assert (tmp_path / "pack.partial").is_dir() and not (tmp_path / "pack").exists()
    result = run_repack(str(source), tmp_path / "pack", RepackOptions(tp=2))
    assert (result.files_resumed, result.files_written) == (1, 3)
    run_repack(str(source), tmp_path / "fresh", RepackOptions(tp=2))
    assert tensor_bytes(tmp_path / "pack") == tensor_bytes(tmp_path / "fresh")


def test_read_back_names_a_changed_byte(capsys, tmp_path):
    """The read-back check itself: one trellis byte changed in a written layer file is found and named."""
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.errors import CheckFailed
    from trellis_cli.dialects.exl3v1.container import container, layer_rates
    from trellis_cli.dialects.exl3v1.pack import expert_tiers
    from trellis_cli.dialects.exl3v1.pack_readback import check_written
    from trellis_cli.header import read_local_header
    from trellis_cli.checkpoint.tensor_bytes import TensorReader

    source = write_exl3v1_checkpoint(tmp_path / "exl3", SPECS["pair-per-expert"])
    assert main_ok(capsys, "repack", str(source), str(tmp_path / "pack"), "--tp", "2")
    path = tmp_path / "pack" / "layer-003-rank-1.safetensors"
    ck = open_checkpoint(source)
    m, layer, rates = container(ck).manifest, container(ck).layers[3], layer_rates(ck, 3)
    tiers = expert_tiers(m, rates, 3)
    with TensorReader(ck.source) as reader:
        check_written(path, m, layer, rates, reader, 1, 2, tiers)  # as written: equal
        header = read_local_header(path, path.name)
        slab = header.tensors["tier1.trellis"]  # the K4 tier: one expert
        data = bytearray(path.read_bytes())
        data[header.data_start + slab.begin + 100] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CheckFailed, match=rf"tier1\.trellis: read back differs .* expert {tiers[1][1][0]}:"):
            check_written(path, m, layer, rates, reader, 1, 2, tiers)


def main_ok(capsys, *args: str) -> bool:
    return run_cli(capsys, *args)[0] == 0


def test_exl3v1_made_from_tr3_packs_and_goes_back_to_that_tr3(capsys, tmp_path):
    """The carried config and note: the pack defaults to the TR3's TP, and --to tr3 restores its files."""
    seed = write_exl3v1_checkpoint(tmp_path / "seed", SPECS["pair-per-expert"])
    assert main_ok(capsys, "repack", str(seed), str(tmp_path / "tr3"), "--to", "tr3", "--tp", "2")
    assert main_ok(capsys, "repack", str(tmp_path / "tr3"), str(tmp_path / "exl3"), "--to", "exl3-v1")
    assert main_ok(capsys, "repack", str(tmp_path / "exl3"), str(tmp_path / "pack"))
    assert json.loads((tmp_path / "pack" / "manifest.json").read_text())["tp"] == 2
    assert main_ok(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "back"), "--to", "tr3")
    capsys.readouterr()
    assert tensor_bytes(tmp_path / "back") == tensor_bytes(tmp_path / "tr3")
    assert (tmp_path / "back" / "config.json").read_text() == (tmp_path / "tr3" / "config.json").read_text()


def test_a_tr3_shard_outside_the_pack_is_refused(capsys, tmp_path):
    """tr3_shard is a name `--to tr3` joins onto OUT: the manifest check vouches for it (hash re-signed here)."""
    from trellis_cli.dialects.routepack import manifest as mf

    source = write_exl3v1_checkpoint(tmp_path / "exl3", SPECS["uniform-shared"])
    assert main_ok(capsys, "repack", str(source), str(tmp_path / "pack"))
    doc, _ = mf.read_manifest(tmp_path / "pack")
    doc["layers"]["3"]["tr3_shard"] = "../escaped.safetensors"
    mf.write_manifest(tmp_path / "pack", doc)
    capsys.readouterr()
    code, text = run_cli(capsys, "validate", str(tmp_path / "pack"))
    assert code == 1 and "path.escape" in text and "tr3_shard" in text
    code, text = run_cli(capsys, "repack", str(tmp_path / "pack"), str(tmp_path / "out" / "tr3"), "--to", "tr3")
    assert code == 1 and "path.escape" in text
    assert not (tmp_path / "out").exists() and not (tmp_path / "escaped.safetensors").exists()
