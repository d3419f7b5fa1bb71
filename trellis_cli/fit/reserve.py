"""The runtime reserve: what a rank holds besides weights and KV cache, term by term (docs/fit.md, "Reserve").

Each term says where it is charged and where its number comes from. Terms the source gives (the MLA
up-projections vLLM derives after loading, the top-k buffer, the DSA indexer's context-sized workspace) are
exact. Terms only a run can measure (the activation peak, CUDA graph pools, memory outside torch, the MoE
path's arena, the CUDA context) are a band: low / typical / high, and the verdict says "fits" only when the
whole band fits. Terms allocated before the engine's memory snapshot (CUDA context, NCCL communicators) are
not charged against the KV budget at a utilization below 1: they must fit in what the utilization leaves
(`outside`), a separate check.
"""

from __future__ import annotations

from dataclasses import dataclass

from trellis_cli.fit.arch import Arch
from trellis_cli.fit.engines import GIB, MIB, EngineVersion, indexer_workspace
from trellis_cli.fit.sharding import VOCAB_PADDING

BF16, FP32, INT32 = 2, 4, 4
CASES = ("low", "typical", "high")


@dataclass(frozen=True)
class Term:
    name: str
    low: int
    typical: int
    high: int
    source: str
    measured: bool  # a band from measurements; False: computed from the model and the engine's source
    outside: bool = False  # allocated before the memory snapshot: not in the KV budget at utilization < 1

    @property
    def bytes(self) -> int:
        return self.typical

    @property
    def estimate(self) -> bool:
        return self.measured

    def at(self, case: str) -> int:
        return {"low": self.low, "typical": self.typical, "high": self.high}[case]


def exact(name: str, nbytes: int, source: str) -> Term:
    return Term(name, nbytes, nbytes, nbytes, source, False)


def activation_peak(arch: Arch, tp: int, tokens: int, max_num_seqs: int) -> int:
    """The largest working set of one forward pass at `tokens` batched tokens, plus the sampler's logits.

    Four hidden-state buffers (residual, normed input, attention and MLP outputs) are live across a layer;
    inside it the largest of attention (queries, the prefill path's expanded keys/values and the output on
    this rank's heads, with the indexer's queries), the router's fp32 logits, the MoE path's gathered
    activations (tokens x top-k x (hidden + 2 x intermediate / TP)) and the dense MLP's intermediate; then the
    sampler's fp32 logits and probabilities over the whole vocabulary per sequence.
    """
    heads = -(-arch.heads // tp)
    hidden = 4 * tokens * arch.hidden * BF16
    attention = tokens * heads * ((arch.qk_nope + arch.qk_rope) + (arch.qk_nope + arch.v_head) + arch.v_head) * BF16
    if arch.index_head_dim and arch.index_heads:
        attention += tokens * arch.index_heads * arch.index_head_dim * BF16
    router = tokens * arch.experts * FP32
    moe = tokens * arch.top_k * (arch.hidden + 2 * -(-arch.moe_intermediate // tp)) * BF16
    dense = tokens * 2 * -(-(arch.dense_intermediate or 0) // tp) * BF16
    vocab = -(-arch.vocab // VOCAB_PADDING) * VOCAB_PADDING
    logits = 2 * max_num_seqs * vocab * FP32
    return hidden + max(attention, router, moe, dense) + logits


def mla_derived(arch: Arch, tp: int, layers: int) -> int:
    """`W_UK_T` and `W_UV`, bf16 per layer on this rank's heads, that MLA derives from kv_b_proj after loading
    (model_executor/layers/attention/mla_attention.py: MLAAttention.process_weights_after_loading)."""
    heads = -(-arch.heads // tp)
    return layers * heads * (arch.qk_nope * arch.kv_lora_rank + arch.kv_lora_rank * arch.v_head) * BF16


def _band(typical: int, low_share: float = 0.5, high_share: float = 1.5) -> tuple[int, int, int]:
    return int(typical * low_share), typical, int(typical * high_share)


def reserve_terms(arch: Arch, engine: EngineVersion, tp: int, dcp: int, max_num_seqs: int, max_batched_tokens: int,
                  ctx: int, mtp: bool) -> list[Term]:
    """Every term of the reserve on one rank for this engine version, in the order the engine allocates them."""
    layers = arch.layers + (arch.mtp_layers if mtp else 0)
    terms = [
        Term("CUDA context and library handles", 512 * MIB, 768 * MIB, 1 * GIB,
             "created before the worker's memory snapshot (v1/worker/gpu_worker.py: init_device); 0.5-1 GiB "
             "measured on Hopper and Blackwell", True, outside=True),
    ]
    if tp > 1:
        terms.append(Term("NCCL communicators", 128 * MIB, 256 * MIB, 512 * MIB,
                          "initialised with the process groups before the snapshot; grows with channels and ranks",
                          True, outside=True))
    terms += [
        exact("MLA W_UK_T / W_UV", mla_derived(arch, tp, layers), "bf16 up-projections derived from kv_b_proj "
              "after loading (mla_attention.py: MLAAttention.process_weights_after_loading)"),
    ]
    if arch.index_head_dim:
        terms.append(exact("DSA top-k indices buffer", max_batched_tokens * 2048 * INT32,
                           f"int32 [{max_batched_tokens} batched tokens, index_topk 2048] "
                           "(deepseek_v2.py: DeepseekV2Model.__init__ topk_indices_buffer)"))
        terms.append(exact("DSA indexer workspace", indexer_workspace(ctx, engine),
                           f"grows with the context: {ctx:,} x 40 x 132 B (indexer.py: get_max_prefill_buffer_size)"
                           + (" + 512 MiB the fork adds" if engine.indexer_workspace_fixed else "")))
    peak = activation_peak(arch, tp, max_batched_tokens, max_num_seqs)
    shapes = (f"at {max_batched_tokens} batched tokens and {max_num_seqs} sequences ({engine.moe_path} "
              "included); fit's formula from the model shapes, the engine measures it: -50 % / +50 %")
    if engine.extensible_kv_cache:  # kept free after warm-up: the peak and a margin of max(1 GiB, 0.75 x peak)
        low, typical, high = (p + max(GIB, p * 3 // 4) for p in _band(peak))
        terms.append(Term("activation peak, held free with its margin", low, typical, high,
                          f"the warm-up's transient peak {shapes}, plus max(1 GiB, 0.75 x peak) "
                          "(v1/worker/extensible_kv_cache.py: measure_kv_cache_bytes)", True))
    else:
        terms.append(Term("activation peak", *_band(peak), f"the profile run {shapes} (gpu_worker.py: "
                          "determine_available_memory)", True))
    if engine.loads_exl3:
        arena = (280 * MIB, 760 * MIB, 1 * GIB)
        if mtp:
            arena = (arena[0] + 414 * MIB, arena[1] + 1054 * MIB, arena[2] + 1280 * MIB)
        terms.append(Term("EXL3 MoE prefill arena", *arena, "the fork's EXL3 MoE method sizes it by "
                          "VLLM_EXL3_PREFILL_CAPACITY (default max_num_batched_tokens; quantization/exl3.py: "
                          "_resolve_prefill_capacity); rigs measured 280 MiB at capacity 1024, 760 MiB unset"
                          + (", and 414-1054 MiB more for the MTP draft" if mtp else ""), True))
    terms.append(Term("CUDA graph pools", 256 * MIB, 512 * MIB, 1 * GIB,
                      "decode graphs at the default capture sizes; engines log 0.2-1 GiB "
                      "(gpu_worker.py: determine_available_memory subtracts the measured estimate)", True))
    comm = (64 * MIB, 256 * MIB, 512 * MIB) if tp > 1 else (0, 64 * MIB, 128 * MIB)
    if dcp > 1:  # a rig report: DCP 1 -> 4 cost about 174 MiB more per rank
        comm = (comm[0] + 128 * MIB, comm[1] + 174 * MIB, comm[2] + 256 * MIB)
    terms.append(Term("memory outside torch after the snapshot", *comm, "custom all-reduce buffers, NCCL "
                      "growth" + (", the DCP all-gather" if dcp > 1 else "") + " (gpu_worker.py: the non-torch "
                      "increase)", True))
    return terms


def in_budget(terms: list[Term], case: str) -> int:
    return sum(t.at(case) for t in terms if not t.outside)


def outside_budget(terms: list[Term], case: str) -> int:
    return sum(t.at(case) for t in terms if t.outside)


__all__ = ["CASES", "Term", "activation_peak", "in_budget", "mla_derived", "outside_budget", "reserve_terms"]
