"""The tensor-parallel degree a loader will run a checkpoint at: each profile's TP contract, per dialect.

`trellis validate --tp N` (and `inspect --tp N`) names the TP the server will be started at; each profile's
`tp_rule(ckpt, tp)` says why that loader refuses it (a Refusal, code `engine.tp`) or None. Without `--tp`,
`accepted_tp` lists the degrees a profile would take (within 1..MAX_TP), or None when the profile puts no
limit of its own on TP. docs/engines.md cites where each contract comes from.
"""

from __future__ import annotations

from typing import Any, Callable

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.dialects.interface import VLLM_MANIFEST
from trellis_cli.dialects.registry import dialect_of
from trellis_cli.findings import Location
from trellis_cli.header import coerced_int
from trellis_cli.validate.engine_rules import Refusal

MAX_TP = 64  # the degrees listed without --tp: beyond any rig the loaders serve
SLICE_QUANTUM = 128  # per-rank intermediate slices are cut on Hadamard-block boundaries
MANIFEST_TP = range(2, 25)  # the mainline extent planner's TP range (utils/exl3.py plan_exl3_extent)
GLM53_SCOPE_TP = 2  # the GLM-5.3 unsliced stream scope hard-codes its TP (no EP here)

TpRule = Callable[[Checkpoint, int], "Refusal | None"]


def _refuse(reason: str, message: str, expected: Any, tp: int, where: Location | None = None) -> Refusal:
    return Refusal("engine.tp", reason, where or Location(), message, expected=expected, found=tp)


def checkpoint_tp(ckpt: Checkpoint) -> int | None:
    hybrid = dialect_of(ckpt).rank_sliced_contract(ckpt)
    return coerced_int(hybrid.get("tp")) if hybrid is not None else None


def rank_sliced_tp(ckpt: Checkpoint, tp: int) -> Refusal | None:
    """Every fork version: a rank-sliced checkpoint is served at exactly its recorded `tp` (create_weights)."""
    recorded = checkpoint_tp(ckpt)
    if recorded is not None and recorded != tp:
        return _refuse(f"checkpoint TP {recorded}, server TP {tp}", "a rank-sliced checkpoint's recorded tp is a "
                       "hard contract: the loader stops when the server's TP differs", recorded, tp,
                       Location(file="config.json", tensor="hybrid_tr3_tail.tp"))
    return None


def sliced_at_load_tp(ckpt: Checkpoint, tp: int) -> Refusal | None:
    """Unsliced experts cut per rank at load: each rank's intermediate slice must be whole 128-channel blocks."""
    inter = ckpt.intermediate
    if tp == 1 or inter is None:
        return None
    if inter % tp or (inter // tp) % SLICE_QUANTUM:
        return _refuse(f"intermediate {inter} / TP {tp} not 128-aligned", f"experts are sliced per rank at load: "
                       f"the intermediate size {inter} split {tp} ways must give whole {SLICE_QUANTUM}-channel "
                       "blocks per rank", f"intermediate / tp a multiple of {SLICE_QUANTUM}", tp)
    return None


def fork_tp(ckpt: Checkpoint, tp: int) -> Refusal | None:
    """#190 and shared-H versions: rank-sliced TR3 at its recorded tp; plain EXL3 MoE sliced at load."""
    dialect = dialect_of(ckpt)
    if dialect.rank_sliced_contract(ckpt) is not None:
        return rank_sliced_tp(ckpt, tp)
    if dialect.module_records:
        return sliced_at_load_tp(ckpt, tp)
    return None


def r7_fork_tp(ckpt: Checkpoint, tp: int) -> Refusal | None:
    """The R7 version: TR3 as the others; R7 streamed and sliced per rank; the GLM-5.3 scope at its fixed TP."""
    from trellis_cli.validate.engine_r7 import glm53_scope

    if glm53_scope(ckpt) and tp != GLM53_SCOPE_TP:
        return _refuse(f"GLM-5.3 scope needs TP {GLM53_SCOPE_TP}", "_configure_glm53_unsliced_routed_experts "
                       f"fixes the checkpoint tp at {GLM53_SCOPE_TP} and create_weights refuses another runtime TP "
                       "(\"rank-sliced EXL3 checkpoint TP does not match runtime\"); with expert parallelism "
                       "(allowed for this scope only) the check is skipped and every EP rank loads whole experts, "
                       "forced to K4", GLM53_SCOPE_TP, tp, Location(file="config.json",
                                                                   tensor="quantization_config.scope"))
    if dialect_of(ckpt).streamed_k_maps:
        return sliced_at_load_tp(ckpt, tp)
    return fork_tp(ckpt, tp)


def pr766_tp(ckpt: Checkpoint, tp: int) -> Refusal | None:
    """PR #766 (open): the unsliced stream's recorded TP only describes its origin, so any TP whose per-rank
    intermediate slice is whole 128-channel blocks (the shape checks still apply; TP 1 is not sliced)."""
    from trellis_cli.validate.engine_r7 import glm53_scope

    if not glm53_scope(ckpt):
        return None
    refused = sliced_at_load_tp(ckpt, tp)
    if refused is None:
        return None
    return refused._replace(message=refused.message + " (_validate_moe_shapes: svh/suh lengths multiples of 128; "
                            "the narrow is \"not quantum-aligned\" otherwise)",
                            where=Location(file="config.json", tensor="text_config.moe_intermediate_size"))


def manifest_tp(ckpt: Checkpoint, tp: int) -> Refusal | None:
    """The mainline loader's extent plan (utils/exl3.py plan_exl3_extent, then b12x's validate_extent)."""
    dialect = dialect_of(ckpt)
    if dialect.container_refusal(VLLM_MANIFEST) is not None:
        return None
    found = dialect.slot_manifest(ckpt)
    if found is None:
        return None
    m, manifest_file = found
    if tp not in MANIFEST_TP:
        return _refuse(f"TP {tp} outside 2..24", "the extent planner takes TP 2..24 only", "2..24", tp)
    half = m.num_slots // 2
    align = m.extent_alignment
    if tuple(m.barriers) != (half,) or 2 * half != m.num_slots or align <= 0 or half % align:
        return _refuse("not one barrier at the halfway slot", "the extent planner needs exactly one barrier, at "
                       "the halfway slot, between two halves of whole alignment blocks",
                       f"barriers [{half}]", tp, Location(file=manifest_file, tensor="layout"))
    # Each half's blocks are dealt to ceil(tp/2) (first half) or floor(tp/2) ranks, in whole blocks; ownership
    # only rotates between layers, so every layer has the same shares: a rank gets none when the first half has
    # fewer blocks than ranks.
    blocks, ranks = half // align, (tp + 1) // 2
    if blocks < ranks:
        return _refuse(f"empty extent at TP {tp}", f"each half has {blocks} alignment block(s) of {align} slots for "
                       f"{ranks} ranks: a rank gets no slots, and an empty extent is refused", "a non-empty extent",
                       tp, Location(file=manifest_file, tensor="layout"))
    return None


def accepted_tp(rule: TpRule | None, ckpt: Checkpoint) -> list[int] | None:
    """The degrees in 1..MAX_TP the rule accepts; None when it accepts every one (no contract of its own)."""
    if rule is None:
        return None
    degrees = [tp for tp in range(1, MAX_TP + 1) if rule(ckpt, tp) is None]
    return None if len(degrees) == MAX_TP else degrees
