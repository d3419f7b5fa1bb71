"""The runtime reserve: what a rank holds besides weights and KV cache, term by term (docs/fit.md, "Reserve").

The engine sizes its KV pool as `total * gpu_memory_utilization` less everything else its profile run saw:
weights, the activation peak of a forward pass at its batch limits, memory outside torch's allocator (CUDA
context, communication buffers) and the CUDA graph pools its capture pass measures. Each term says where it
comes from and whether it is an estimate. The mixed-K kernel's workspace is exact: the launch plan of trellis's fused kernel
at the profile run's token count.
"""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.fit.arch import Arch
from trellis_cli.fit.sharding import VOCAB_PADDING

MIB = 1 << 20
GIB = 1 << 30
BF16, FP32 = 2, 4

CUDA_CONTEXT = 768 * MIB  # CUDA context, cuBLAS / cuDNN handles and the allocator's first segments
CUDA_GRAPHS = 512 * MIB  # graph pools for the default decode capture sizes
COMM_TP = 256 * MIB  # NCCL channels and the custom all-reduce buffer at TP > 1
COMM_DCP = 128 * MIB  # the DCP all-gather of the latent at DCP > 1


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    source: str
    estimate: bool  # False: computed exactly from the model and the engine's limits


def activation_peak(arch: Arch, tp: int, tokens: int, max_num_seqs: int) -> int:
    """The largest working set of one forward pass at `tokens` batched tokens, plus the sampler's logits.

    Four hidden-state buffers (residual, normed input, attention and MLP outputs) are live across a layer;
    inside it the largest of attention (queries, the prefill path's expanded keys/values and the output on
    this rank's heads, with the indexer's queries), the router's fp32 logits and the dense MLP's
    intermediate; then the sampler's fp32 logits and probabilities over the whole vocabulary per sequence.
    """
    heads = -(-arch.heads // tp)
    hidden = 4 * tokens * arch.hidden * BF16
    attention = tokens * heads * ((arch.qk_nope + arch.qk_rope) + (arch.qk_nope + arch.v_head) + arch.v_head) * BF16
    if arch.index_head_dim and arch.index_heads:
        attention += tokens * arch.index_heads * arch.index_head_dim * BF16
    router = tokens * arch.experts * FP32
    dense = tokens * 2 * -(-(arch.dense_intermediate or 0) // tp) * BF16
    vocab = -(-arch.vocab // VOCAB_PADDING) * VOCAB_PADDING
    logits = 2 * max_num_seqs * vocab * FP32
    return hidden + max(attention, router, dense) + logits


def kernel_workspace(arch: Arch, tp: int, tokens: int) -> int:
    """Bytes of the fused mixed-K kernel's workspace at M = `tokens` (kernel/plan.py), the larger of its
    mma.sync and wgmma plans; one workspace serves every layer."""
    from trellis_cli.kernel.plan import make_plan, workspace_shapes

    intermediate = arch.moe_intermediate // tp
    best = 0
    for wgmma in (False, True):
        plan = make_plan(tokens, arch.top_k, arch.hidden, intermediate, arch.experts, wgmma=wgmma,
                         num_experts=arch.experts)
        total = 0
        for shape, dtype in workspace_shapes(plan, arch.hidden, intermediate).values():
            n = dtype.itemsize
            for d in shape:
                n *= d
            total += n
        best = max(best, total)
    return best


def reserve_terms(arch: Arch, tp: int, dcp: int, max_num_seqs: int, max_batched_tokens: int) -> list[Term]:
    terms = [
        Term("CUDA context", CUDA_CONTEXT, "per process on every GPU, outside torch's allocator; 0.5-1 GiB "
             "measured on Hopper and Blackwell", True),
        Term("activation peak", activation_peak(arch, tp, max_batched_tokens, max_num_seqs),
             f"profile run at {max_batched_tokens} batched tokens and {max_num_seqs} sequences (fit's formula "
             "from the model shapes; the engine measures it: within about +-50 %)", True),
        Term("CUDA graph pools", CUDA_GRAPHS, "decode graphs at the default capture sizes; engines log 0.2-1 GiB "
             "(vLLM subtracts its measured graph memory unless VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0)", True),
    ]
    if tp > 1 or dcp > 1:
        comm = (COMM_TP if tp > 1 else 0) + (COMM_DCP if dcp > 1 else 0)
        terms.append(Term("communication buffers", comm, "NCCL channels, the custom all-reduce buffer"
                          + (" and the DCP all-gather" if dcp > 1 else ""), True))
    terms.append(Term("mixed-K kernel workspace", kernel_workspace(arch, tp, max_batched_tokens),
                      f"trellis's fused kernel launch plan at M = {max_batched_tokens} (kernel/plan.py)", False))
    return terms
