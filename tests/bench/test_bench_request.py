"""`BenchRequest` and `bench_run`: the options' rules said once (bench/request.py RULES), the mode a request
runs, and the library's result being the CLI's document. No GPU needed."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import cuda_available
from helpers import run_cli, tiny_checkpoint, without_hint
from trellis_cli.bench.request import RULES, BenchRequest, Rule
from trellis_cli.bench.run import PlanResult, SmokeResult, bench_run
from trellis_cli.errors import GpuUnavailable, UsageError

# A value that counts as "given" for each option a rule names (each differs from the field's default).
GIVEN = {"plan": True, "compile_only": True, "smoke": True, "compare": "exllamav3", "mixed_gap": True, "tp": 2,
         "device": "cpu", "arch": "sm_90", "codebook": "mcg", "kernels": "k3k4", "rank": 1}
FIELDS = {f.name for f in dataclasses.fields(BenchRequest)}


def _first_broken(given: set[str]) -> Rule | None:
    return next((rule for rule in RULES if rule.broken(frozenset(given))), None)


def _combinations():
    """For each rule: the option with each partner it refuses, and the option without any it needs."""
    for rule in RULES:
        for partner in rule.not_with:
            yield rule, {rule.option, partner}
        if rule.only_with:
            yield rule, {rule.option}


def test_every_rule_names_request_fields():
    for rule in RULES:
        assert {rule.option, *rule.not_with, *rule.only_with} <= FIELDS
        assert rule.option in GIVEN and set(rule.not_with) | set(rule.only_with) <= set(GIVEN)


@pytest.mark.parametrize("rule, given", list(_combinations()), ids=lambda v: "+".join(sorted(v)) if isinstance(v, set) else "")
def test_a_broken_combination_is_refused_with_the_first_broken_rule(rule, given):
    expected = _first_broken(given)
    assert expected is not None
    with pytest.raises(UsageError) as refused:
        BenchRequest(**{name: GIVEN[name] for name in given})
    assert str(refused.value) == expected.message


def test_every_rule_is_the_one_said_for_some_combination():
    said = {id(_first_broken(given)) for _, given in _combinations()}
    assert said == {id(rule) for rule in RULES}


@pytest.mark.parametrize("given", [set(), {"plan", "arch"}, {"compile_only", "arch", "codebook", "kernels"},
                                   {"smoke"}, {"smoke", "device"}, {"smoke", "tp", "device"}, {"mixed_gap"},
                                   {"compare"}, {"plan", "rank"}, {"tp"}])
def test_combinations_no_rule_refuses_are_requests(given):
    assert _first_broken(given) is None
    BenchRequest(synthetic="glm52-tp4", **{name: GIVEN[name] for name in given})


@pytest.mark.parametrize("options, mode", [
    ({}, "throughput"), ({"smoke": True}, "smoke"), ({"plan": True}, "plan"), ({"compile_only": True}, "compile"),
    ({"mixed_gap": True}, "mixed-gap"), ({"tp": 2}, "tp"), ({"smoke": True, "device": "cpu"}, "tp"),
    ({"compare": "exllamav3"}, "throughput"),
])
def test_the_mode_a_request_runs(options, mode):
    assert BenchRequest(**options).mode == mode


@pytest.mark.parametrize("options, message", [
    ({"ms": ()}, "token counts must be 1..65536"), ({"ms": (0,)}, "token counts must be 1..65536"),
    ({"replays": 99}, "--replays 99: at least 100"), ({"tp": 0}, "--tp 0: must be at least 1"),
    ({"device": "tpu", "smoke": True}, "--device 'tpu'"), ({"compare": "vllm"}, "known peers are exllamav3"),
    ({"compile_only": True, "arch": "banana"}, "--arch 'banana'"), ({"jobs": 0}, "build jobs must be at least 1"),
    ({"compile_only": True, "codebook": "nope"}, "nope"),
])
def test_bad_values_are_usage_errors(options, message):
    with pytest.raises(UsageError) as refused:
        BenchRequest(**options)
    assert message in str(refused.value)


def test_arch_is_normalized_when_the_request_is_made():
    assert BenchRequest(compile_only=True, arch="90").arch == "sm_90"


@pytest.mark.parametrize("argv", [["--plan", "--smoke"], ["--arch", "sm_90"], ["--compare", "exllamav3", "--tp", "2"],
                                  ["--mixed-gap", "--smoke"], ["--device", "cpu"], ["--tp", "2", "--rank", "1"]])
def test_the_cli_says_the_rule_the_library_says(capsys, argv):
    options = {"--plan": "plan", "--smoke": "smoke", "--arch": "arch", "--compare": "compare", "--tp": "tp",
               "--mixed-gap": "mixed_gap", "--device": "device", "--rank": "rank"}
    expected = _first_broken({options[a] for a in argv if a in options})
    code, out, err = run_cli(capsys, "bench", "--synthetic", "glm52-tp4", *argv)
    lines = without_hint(err).strip().splitlines()
    assert code == 2 and out == "" and lines == [f"error: {expected.message}"]


def test_a_plan_from_the_library_is_the_cli_document(capsys):
    result = bench_run(BenchRequest(synthetic="glm52-tp4", plan=True, arch="sm_120", ms=(1, 64)))
    assert isinstance(result, PlanResult) and [p.m for p in result.plans] == [1, 64]
    code, out, _ = run_cli(capsys, "bench", "--plan", "--arch", "sm_120", "--synthetic", "glm52-tp4", "--m", "1,64",
                           "--json")
    assert code == 0 and json.loads(out) == json.loads(json.dumps(result.to_json()))


@pytest.mark.skipif(cuda_available(), reason="checks the no-GPU path")
def test_a_gpu_run_without_a_gpu_is_refused_after_the_arguments():
    with pytest.raises(GpuUnavailable):
        bench_run(BenchRequest(synthetic="glm52-tp4", smoke=True))
    with pytest.raises(UsageError, match="must add up"):  # the source's errors come first
        bench_run(BenchRequest(synthetic="glm52-tp4", partition="1/2", smoke=True))


@pytest.mark.slow
def test_the_cpu_smoke_from_the_library_passes_on_a_tiny_checkpoint(tmp_path):
    root = tiny_checkpoint(tmp_path)
    result = bench_run(BenchRequest(source=str(root), smoke=True, device="cpu", tp=2))  # the preset's own TP
    assert isinstance(result, SmokeResult) and result.failure is None and result.checks
    assert result.to_json()["tp"] == 2 and all(c.passed for c in result.checks)


def test_the_docs_table_is_the_rules():
    from pathlib import Path

    from trellis_cli.bench.request import FLAGS

    text = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text(encoding="utf-8")
    head = "| option | refused with | only with |"
    rows = text[text.index(head):].split("\n\n")[0].splitlines()[2:]

    def flags(cell: str) -> tuple[str, ...]:
        return tuple(part.strip().strip("`") for part in cell.split(",") if part.strip())

    documented = [tuple(flags(c) for c in row.strip("|").split("|")) for row in rows]
    assert documented == [((FLAGS[r.option],), tuple(FLAGS[o] for o in r.not_with),
                           tuple(FLAGS[o] for o in r.only_with)) for r in RULES]
