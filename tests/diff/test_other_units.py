"""diff's non-expert units: where the layers hold every tensor under `.mlp.experts.` (counted), the others are the
rest of the tensors; the answer is the one the set of held names gives, on checkpoints where the count holds and
where it does not (a name the layers reject, two names of one linear field)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from corrupt import SHARD3, SHARD4, read_header, write_header
from trellis_cli.dialects import units
from trellis_cli.dialects.open import open_checkpoint
from trellis_cli.synth import preset, write_checkpoint


def _rename(root, shard, rename):
    _, doc = read_header(root / shard)
    write_header(root / shard, {n if n == "__metadata__" else rename(n): e for n, e in doc.items()})


CASES = {
    "tr3 with its model weights": lambda root: root,
    "shared-H": None,
    "a zero-padded expert id (not held)": lambda root: _rename(root, SHARD4, lambda n: n.replace("experts.3.", "experts.03.")),
    "two names of one field (one held)": lambda root: _alias(root),
}


def _alias(root):
    """A second name (the `w1` template) for one linear's trellis: both read as one field, one of them is held."""
    _, doc = read_header(root / SHARD3)
    name = next(n for n in doc if n.endswith("experts.1.gate_proj.rank0.trellis"))
    doc[name.replace(".gate_proj.", ".w1.")] = dict(doc[name])
    write_header(root / SHARD3, doc)


@pytest.mark.parametrize("case", list(CASES))
def test_other_units_by_count_equal_those_by_name(case, tmp_path):
    spec = replace(preset("tiny"), non_expert="bf16")
    if CASES[case] is None:
        root = write_checkpoint(tmp_path / "c", replace(spec, rotation_layout="shared_h_v1"))
    else:
        root = write_checkpoint(tmp_path / "c", spec)
        CASES[case](root)
    ck = open_checkpoint(root)
    expertish = sum(".mlp.experts." in name for name in ck.tensors)
    assert (units._held(ck) == expertish) == (case in ("tr3 with its model weights", "shared-H"))
    consumed = units.expert_tensor_names(ck)
    by_name = units.named_units(ref for name, ref in ck.tensors.items() if name not in consumed)
    counted = units.shard_other_units(ck, from_tensors=True)
    assert counted == by_name and list(counted) == list(by_name)
    assert units.shard_other_units(ck) == by_name
    assert any(key[1].startswith("model.embed") for key in by_name)
