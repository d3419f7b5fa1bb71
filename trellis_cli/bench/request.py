"""`BenchRequest`: one `trellis bench` run, typed and checked before anything is read, built or run on a GPU.

A request is one of six runs, its `mode`, chosen by the options given (first match wins):

    plan        launch plans of each M for an arch, checked against its limits (no GPU, no build)
    compile     build the kernel library (no GPU)
    tp          the layer tensor-parallel, one rank process per GPU (or the CPU reference per rank: --device cpu)
    mixed-gap   a mixed synthetic layer timed beside uniform layers of each of its K
    smoke       fused vs two-pass vs float64 reference on one GPU
    throughput  time the fused kernel on one GPU (optionally beside a peer's MoE layer: compare)

Which options combine is said once, in RULES: each rule names an option (a field, "given" when it differs from
its default) and the options it refuses beside it or needs beside it. The first rule broken is the usage error.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trellis_cli.errors import GpuUnavailable, UsageError

DEFAULT_MS = (1, 8, 64, 512, 3072)
MAX_M = 65536
MIN_REPLAYS = 100
PEERS = ("exllamav3",)
DEVICES = ("cuda", "cpu")

# The CLI's spelling of each field, for the messages.
FLAGS = {"source": "SOURCE", "synthetic": "--synthetic", "partition": "--partition", "layer": "--layer",
         "rank": "--rank", "ms": "--m", "smoke": "--smoke", "cold": "--cold/--warm", "replays": "--replays",
         "seed": "--seed", "compile_only": "--compile-only", "plan": "--plan", "arch": "--arch",
         "codebook": "--codebook", "kernels": "--kernels", "jobs": "--jobs", "mixed_gap": "--mixed-gap", "tp": "--tp",
         "device": "--device", "compare": "--compare"}


@dataclass(frozen=True)
class Rule:
    """`option` given is refused when any of `not_with` is given too, or unless one of `only_with` is."""

    option: str
    message: str
    not_with: tuple[str, ...] = ()
    only_with: tuple[str, ...] = ()

    def broken(self, given: frozenset[str]) -> bool:
        if self.option not in given:
            return False
        return bool(given & set(self.not_with)) or bool(self.only_with and not given & set(self.only_with))


RULES: tuple[Rule, ...] = (
    Rule("plan", "--plan prints launch plans only: it does not combine with --compile-only, --smoke, --compare, "
                 "--mixed-gap or --tp", not_with=("compile_only", "smoke", "compare", "mixed_gap", "tp")),
    Rule("compare", "--compare applies to a throughput run, not to --compile-only", not_with=("compile_only",)),
    Rule("arch", "--arch applies to --compile-only (a run builds for the GPU present)",
         only_with=("compile_only", "plan")),
    Rule("codebook", "--codebook applies to --compile-only (a run builds the codebook of its layer)",
         only_with=("compile_only", "plan")),
    Rule("kernels", "--kernels applies to --compile-only (a run builds the kernels its layer needs)",
         only_with=("compile_only", "plan")),
    Rule("compare", "--compare times the peer beside the throughput run of one GPU; it does not combine with "
                    "--smoke, --mixed-gap, --tp or --device", not_with=("smoke", "mixed_gap", "tp", "device")),
    Rule("mixed_gap", "--mixed-gap times one GPU's layers; it does not combine with --tp or --device",
         not_with=("tp", "device")),
    Rule("mixed_gap", "--mixed-gap is a throughput run: drop --smoke (run --smoke on its own)", not_with=("smoke",)),
    Rule("device", "--device cpu runs the check only (add --smoke); timing needs GPUs", only_with=("smoke",)),
    Rule("rank", "--rank does not apply with --tp: every rank runs, one process each", not_with=("tp", "device")),
)


@dataclass(frozen=True)
class BenchRequest:
    source: str | None = None  # a route pack, or a checkpoint any dialect reads (path or org/name)
    synthetic: str | None = None  # a synthetic layer preset (bench/synthetic.py PRESETS), instead of SOURCE
    partition: str | None = None  # experts per tier of the synthetic layer, e.g. "192/64"
    layer: int | None = None  # the MoE layer of SOURCE; None: its first
    rank: int = 0  # the tensor-parallel rank of SOURCE's layer (one GPU's runs)
    ms: tuple[int, ...] = DEFAULT_MS  # token counts to time, or to plan
    smoke: bool = False  # check fused vs two-pass vs float64 reference instead of timing
    cold: bool = True  # cycle weight copies so no replay hits L2
    replays: int = MIN_REPLAYS  # CUDA-graph replays per measurement
    seed: int = 0  # synthetic weights, inputs and routes
    compile_only: bool = False  # build the kernel library and stop
    plan: bool = False  # launch plans only
    arch: str | None = None  # compile or plan for this arch (normalized, e.g. sm_90); None: this GPU's
    codebook: str | None = None  # compile this codebook only
    kernels: str | None = None  # compile this kernel set: all or k3k4
    jobs: int | None = None  # kernel units compiled at once; None: $TRELLIS_BUILD_JOBS, else one per core
    mixed_gap: bool = False  # the mixed synthetic layer beside uniform layers of each K
    tp: int | None = None  # N rank processes, one slice each, outputs all-reduced
    device: str = "cuda"  # cpu: --smoke per rank with the CPU reference over gloo
    compare: str | None = None  # a peer (PEERS) timed beside the throughput run

    def __post_init__(self) -> None:
        self._check_values()
        broken = next((rule for rule in RULES if rule.broken(self.given)), None)
        if broken is not None:
            raise UsageError(broken.message)
        if self.arch is not None:
            object.__setattr__(self, "arch", normalized_arch(self.arch))

    @property
    def given(self) -> frozenset[str]:
        """The fields that differ from their defaults: what the user asked for."""
        return frozenset(f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default)

    @property
    def mode(self) -> str:
        if self.plan:
            return "plan"
        if self.compile_only:
            return "compile"
        if self.tp is not None or self.device != "cuda":
            return "tp"
        if self.mixed_gap:
            return "mixed-gap"
        return "smoke" if self.smoke else "throughput"

    def _check_values(self) -> None:
        """Each value on its own (before the combinations): a misspelt name or an out-of-range count."""
        from trellis_cli.kernel.build import build_jobs, check_codebook, check_kernels

        build_jobs(self.jobs)
        if self.codebook is not None:
            check_codebook(self.codebook)
        if self.kernels is not None:
            check_kernels(self.kernels)
        if not self.ms or any(type(m) is not int or m < 1 or m > MAX_M for m in self.ms):
            raise UsageError(f"--m {','.join(map(str, self.ms))}: token counts must be 1..{MAX_M}")
        if self.replays < MIN_REPLAYS:
            raise UsageError(f"--replays {self.replays}: at least {MIN_REPLAYS}")
        if self.compare is not None and self.compare not in PEERS:
            raise UsageError(f"--compare {self.compare!r}: known peers are {', '.join(PEERS)}")
        if self.tp is not None and self.tp < 1:
            raise UsageError(f"--tp {self.tp}: must be at least 1")
        if self.device not in DEVICES:
            raise UsageError(f"--device {self.device!r}: expected one of {', '.join(DEVICES)}")


def parse_ms(text: str) -> tuple[int, ...]:
    """`--m 1,8,64`: the token counts, in the order given."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"--m {text!r}: expected comma-separated token counts like 1,8,64") from None
    if not values or any(v < 1 or v > MAX_M for v in values):
        raise UsageError(f"--m {text!r}: token counts must be 1..{MAX_M}")
    return values


def normalized_arch(text: str) -> str:
    """`--arch sm_90`, `90` or `9.0` as the build names it (sm_90); a misspelling is a usage error."""
    from trellis_cli.kernel.nvcc import normalize_arch

    try:
        return normalize_arch(text)
    except GpuUnavailable as err:  # a misspelt option, not a missing GPU
        raise UsageError(f"--arch {text!r}: {err}") from None
