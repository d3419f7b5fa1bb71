"""repack to and from exl3-v1: round trips bit-exact in every tensor, any allowed --tp, refusals write nothing."""

from __future__ import annotations

import pytest

from trellis_cli.synth import SynthSpec, write_checkpoint
from helpers import run_cli_merged as run_cli
from helpers import tensor_bytes


def test_exl3_tr3_exl3_round_trip(capsys, exl3, tmp_path):
    code, text = run_cli(capsys, "repack", str(exl3), str(tmp_path / "tr3"), "--to", "tr3")
    assert code == 0, text
    code, text = run_cli(capsys, "validate", str(tmp_path / "tr3"))
    assert code == 0 and "tr3/" in text, text
    code, text = run_cli(capsys, "repack", str(tmp_path / "tr3"), str(tmp_path / "back"), "--to", "exl3-v1")
    assert code == 0, text
    assert tensor_bytes(tmp_path / "back") == tensor_bytes(exl3)
    assert (tmp_path / "back" / "exl3-manifest.json").read_bytes() == (exl3 / "exl3-manifest.json").read_bytes()


@pytest.mark.parametrize("tp", [1, 2])
def test_tr3_exl3_tr3_round_trip_at_each_tp(capsys, exl3, tmp_path, tp):
    assert run_cli(capsys, "repack", str(exl3), str(tmp_path / "a"), "--to", "tr3", "--tp", str(tp))[0] == 0
    assert run_cli(capsys, "repack", str(tmp_path / "a"), str(tmp_path / "x"), "--to", "exl3-v1")[0] == 0
    code, text = run_cli(capsys, "repack", str(tmp_path / "x"), str(tmp_path / "b"), "--to", "tr3")
    assert code == 0, text
    assert tensor_bytes(tmp_path / "b") == tensor_bytes(tmp_path / "a")
    assert (tmp_path / "b" / "config.json").read_text() == (tmp_path / "a" / "config.json").read_text()


def test_tp_the_layout_does_not_allow_is_refused(capsys, exl3, tmp_path):
    code, text = run_cli(capsys, "repack", str(exl3), str(tmp_path / "t"), "--to", "tr3", "--tp", "3")
    assert code == 2 and "slot layout" in text
    assert not (tmp_path / "t").exists() and not (tmp_path / "t.partial").exists()


def test_tr3_with_per_rank_hidden_vectors_is_refused_before_writing(capsys, tmp_path):
    spec = SynthSpec(hidden=256, intermediate=1024, experts=4, tp=2, layers=(3,), partition=(3, 1), top_k=2)
    source = write_checkpoint(tmp_path / "tr3", spec)
    code, text = run_cli(capsys, "repack", str(source), str(tmp_path / "out"), "--to", "exl3-v1")
    assert code == 1 and "exl3v1.h-side-differs" in text
    assert "layer 3 expert 0 gate_proj suh: rank 1 differs from rank 0" in text
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_mixed_k_without_whole_pairs_per_rank_is_refused(capsys, tmp_path):
    spec = SynthSpec(hidden=256, intermediate=256, experts=4, tp=2, layers=(3,), partition=(3, 1), top_k=2)
    source = write_checkpoint(tmp_path / "tr3", spec)
    code, text = run_cli(capsys, "repack", str(source), str(tmp_path / "out"), "--to", "exl3-v1")
    assert code == 2 and "256-channel pairs" in text and not (tmp_path / "out").exists()


def test_bench_source_pack_equals_the_converted_tr3_pack(exl3, tmp_path):
    from trellis_cli.bench.source import load_bench_source
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.dialects.shard_pack import pack_layer
    from trellis_cli.dialects.routepack.readback import same_bits
    from trellis_cli import RepackOptions, run_repack

    run_repack(str(exl3), tmp_path / "tr3", RepackOptions(to="tr3", tp=4))  # bench: the largest TP <= 4
    got = load_bench_source(str(exl3), synthetic=None, partition=None, layer=3, rank=1, device="cpu").pack
    want = pack_layer(open_checkpoint(tmp_path / "tr3"), 3, 1)
    assert got.tier_k == want.tier_k and all(same_bits(a, b) for a, b in zip(got.tier_trellis, want.tier_trellis))
    assert same_bits(got.rot_intermediate, want.rot_intermediate) and same_bits(got.gate_suh, want.gate_suh)
