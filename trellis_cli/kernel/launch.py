"""Checked launch of the fused MoE kernel on torch's current CUDA stream.

`FusedMoe(pack)` binds a LayerPack (moved to the GPU once) to the compiled library. `forward` checks
every input (device, dtype, shape, contiguity), sizes the workspace from the plan for M (allocated on
the first call of each M and reused, so a call can be captured in a CUDA graph after one eager call),
and launches with no host synchronisation. `two_pass` is the baseline: the same kernel run once per
tier with the other tiers unmapped, outputs summed.
"""

from __future__ import annotations

import ctypes

import torch

from trellis_cli.errors import CheckFailed, GpuUnavailable
from trellis_cli.kernel import abi
from trellis_cli.kernel.arch_limits import ArchLimits, device_limits
from trellis_cli.kernel.plan import LaunchPlan, check_pack_layout, kernel_set, make_plan, workspace_shapes
from trellis_cli.kernel.resources import read_record, record_path
from trellis_cli.formats.layer_pack import CODEBOOK_IDS, LayerPack, split_descriptor

_X_DTYPES = {torch.float16: abi.DT_FP16, torch.bfloat16: abi.DT_BF16}
_OUT_DTYPES = {torch.float32: abi.DT_FP32, torch.float16: abi.DT_FP16, torch.bfloat16: abi.DT_BF16}
# CUDA errors that mean the library cannot run on this GPU at all: what each says, in one line.
_CANNOT_RUN = {
    35: "the NVIDIA driver is older than this CUDA runtime",  # cudaErrorInsufficientDriver
    98: "the library holds no code for this GPU's arch",  # cudaErrorInvalidDeviceFunction
    209: "the library holds no code for this GPU's arch",  # cudaErrorNoKernelImageForDevice
    222: "the NVIDIA driver is too old for the library's arch (its PTX is newer than the driver)",  # UnsupportedPtxVersion
}


def launch_failure(rc: int, message: str, library_arch: str, plan: LaunchPlan, limits: ArchLimits) -> str:
    """One line for a CUDA error of the library's launch sequence: the GPU's arch and the library's, what the
    error means, the library's own message (which names the kernel, its threads and shared memory), the plan
    and the limits it was made for."""
    reason = _CANNOT_RUN.get(rc, "the device refused the launch")
    text = " ".join(f"{reason}: {message}".split())
    return (f"fused kernel on {limits.arch} (library built for {library_arch or 'an unknown arch'}): {text} "
            f"(plan: {plan.describe()}; {limits.describe()})")


def pack_to_device(pack: LayerPack, device: torch.device) -> LayerPack:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device).contiguous()

    return LayerPack(
        layer=pack.layer, rank=pack.rank, tp=pack.tp, hidden=pack.hidden, intermediate=pack.intermediate,
        codebook=pack.codebook, tier_k=list(pack.tier_k), tier_trellis=[move(t) for t in pack.tier_trellis],
        global_to_combined=move(pack.global_to_combined), descriptors=move(pack.descriptors),
        rot_intermediate=move(pack.rot_intermediate), gate_suh=move(pack.gate_suh), up_suh=move(pack.up_suh),
        down_svh=move(pack.down_svh),
    )


class FusedMoe:
    """One (layer, rank) route pack on one GPU, ready to launch."""

    def __init__(self, pack: LayerPack, library: abi.KernelLibrary | None = None,
                 device: torch.device | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise GpuUnavailable("no CUDA device visible: the fused kernel needs an NVIDIA GPU")
        check_pack_layout(pack)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.pack = pack_to_device(pack, self.device)
        needed = kernel_set(pack)
        self.library = library or abi.default_library(pack.codebook, kernels=needed)
        if self.library.codebook and self.library.codebook != pack.codebook:
            raise CheckFailed(f"kernel library {self.library.path} holds the {self.library.codebook} codebook's "
                              f"kernels; layer {pack.layer} uses {pack.codebook} (one library per codebook)")
        if self.library.kernels == "k3k4" and needed != "k3k4":
            raise CheckFailed(f"kernel library {self.library.path} holds only the K3/K4 kernels; layer "
                              f"{pack.layer} has tiers of K {sorted(set(pack.tier_k))} (build the kernel set 'all')")
        # The plan is made for this device's own limits (or TRELLIS_PLAN_LIMITS's arch, test-only), with the
        # registers and static shared memory ptxas recorded for the library's kernels.
        self.limits = device_limits(self.device.index)
        self.usage = read_record(record_path(self.library.path))
        self._workspaces: dict[LaunchPlan, dict[str, torch.Tensor]] = {}
        self._tier_maps: dict[int, torch.Tensor] = {}

    @property
    def num_tiers(self) -> int:
        return len(self.pack.tier_trellis)

    def plan(self, m: int, top_k: int) -> LaunchPlan:
        return make_plan(m, top_k, self.pack.hidden, self.pack.intermediate, self.pack.num_combined,
                         wgmma=self.library.wgmma, num_experts=int(self.pack.global_to_combined.shape[0]),
                         limits=self.limits, codebook=self.pack.codebook, fast=kernel_set(self.pack) == "k3k4",
                         usage=self.usage)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                out: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                tier: int | None = None, plan: LaunchPlan | None = None) -> torch.Tensor:
        """out[t] = Σ_k w[t,k]·expert(x[t]); with `tier`, only that tier's experts are served."""
        return self._launch(x, topk_ids, topk_weights, out, out_dtype, tier, plan)

    def two_pass(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 out: torch.Tensor | None = None, plan: LaunchPlan | None = None) -> torch.Tensor:
        """The baseline: one launch per tier (other tiers unmapped), fp32 outputs summed in tier order;
        with `plan`, every tier runs on those tiles (as a fused call with that plan does)."""
        parts = [self.forward(x, topk_ids, topk_weights, tier=t, plan=plan) for t in range(self.num_tiers)]
        total = parts[0] if out is None else out.copy_(parts[0])
        for part in parts[1:]:
            total.add_(part)
        return total

    # -- internals -----------------------------------------------------------------------------------

    def _launch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                out: torch.Tensor | None, out_dtype: torch.dtype, tier: int | None, plan: LaunchPlan | None,
                **fields: int) -> torch.Tensor:
        """One checked call; `fields` are further scalars of the library's arguments (a lab build's flags)."""
        self._check_inputs(x, topk_ids, topk_weights)
        m, top_k = int(topk_ids.shape[0]), int(topk_ids.shape[1])
        if out is None:
            out = torch.empty((m, self.pack.hidden), dtype=out_dtype, device=self.device)
        self._check_out(out, m)
        plan = plan or self.plan(m, top_k)
        args = self._args(x, topk_ids, topk_weights, out, plan, tier)
        for name, value in fields.items():
            setattr(args, name, int(value))
        rc, message = self.library.forward(args, torch.cuda.current_stream(self.device).cuda_stream)
        if rc < 0:
            raise CheckFailed(f"fused kernel rejected its arguments: {message}")
        if rc > 0:
            raise GpuUnavailable(launch_failure(rc, message, self.library.arch, plan, self.limits))
        return out

    def _check_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        hidden = self.pack.hidden
        if x.device != self.device or x.dtype not in _X_DTYPES or x.dim() != 2 or int(x.shape[1]) != hidden:
            raise CheckFailed(f"x: expected fp16/bf16 [M, {hidden}] on {self.device}, found {x.dtype} "
                              f"{list(x.shape)} on {x.device}")
        if topk_ids.device != self.device or topk_ids.dtype not in (torch.int32, torch.int64) \
                or topk_ids.dim() != 2 or int(topk_ids.shape[0]) != int(x.shape[0]):
            raise CheckFailed(f"topk_ids: expected int32/int64 [{x.shape[0]}, k] on {self.device}, found "
                              f"{topk_ids.dtype} {list(topk_ids.shape)} on {topk_ids.device}")
        if topk_weights.device != self.device or topk_weights.dtype != torch.float32 \
                or topk_weights.shape != topk_ids.shape:
            raise CheckFailed(f"topk_weights: expected float32 {list(topk_ids.shape)} on {self.device}, found "
                              f"{topk_weights.dtype} {list(topk_weights.shape)} on {topk_weights.device}")
        for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not t.is_contiguous():
                raise CheckFailed(f"{name}: must be contiguous")

    def _check_out(self, out: torch.Tensor, m: int) -> None:
        want = [m, self.pack.hidden]
        if out.device != self.device or out.dtype not in _OUT_DTYPES or list(out.shape) != want \
                or not out.is_contiguous():
            raise CheckFailed(f"out: expected contiguous fp32/fp16/bf16 {want} on {self.device}, found "
                              f"{out.dtype} {list(out.shape)} on {out.device}")

    def _workspace(self, plan: LaunchPlan) -> dict[str, torch.Tensor]:
        if plan not in self._workspaces:
            shapes = workspace_shapes(plan, self.pack.hidden, self.pack.intermediate)
            self._workspaces[plan] = {
                name: torch.empty(shape, dtype=dtype, device=self.device) for name, (shape, dtype) in shapes.items()
            }
            # the hand-over counters start at zero; every call leaves them at zero again (kernels/handover.cuh)
            self._workspaces[plan]["handover"].zero_()
        return self._workspaces[plan]

    def _global_map(self, tier: int | None) -> torch.Tensor:
        if tier is None:
            return self.pack.global_to_combined
        if not 0 <= tier < self.num_tiers:
            raise CheckFailed(f"tier {tier} out of range 0..{self.num_tiers - 1}")
        if tier not in self._tier_maps:
            g2c = self.pack.global_to_combined
            valid = g2c >= 0
            tiers = torch.where(valid, split_descriptor(self.pack.descriptors[g2c.clamp(min=0).long()])[0], -1)
            self._tier_maps[tier] = torch.where(tiers == tier, g2c, torch.full_like(g2c, -1)).contiguous()
        return self._tier_maps[tier]

    def _args(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor,
              plan: LaunchPlan, tier: int | None) -> ctypes.Structure:
        pack = self.pack
        ws = self._workspace(plan)
        a = self.library.args_type()
        for t, trellis in enumerate(pack.tier_trellis):
            a.tier_trellis[t] = trellis.data_ptr() if trellis.numel() else None
            a.tier_k[t] = int(pack.tier_k[t])
            a.tier_size[t] = int(trellis.shape[0])
        pointers = {
            "global_to_combined": self._global_map(tier), "descriptors": pack.descriptors,
            "rot_intermediate": pack.rot_intermediate, "gate_suh": pack.gate_suh, "up_suh": pack.up_suh,
            "down_svh": pack.down_svh, "x": x, "topk_ids": topk_ids, "topk_weights": topk_weights, "out": out,
            **ws,
        }
        for name, tensor in pointers.items():
            setattr(a, name, ctypes.c_void_p(tensor.data_ptr()))
        scalars = {
            "abi_version": abi.ABI_VERSION, "num_tiers": self.num_tiers, "hidden": pack.hidden,
            "intermediate": pack.intermediate, "num_experts": int(pack.global_to_combined.shape[0]),
            "num_combined": pack.num_combined, "codebook": CODEBOOK_IDS[pack.codebook],
            "gate_suh_shared": int(pack.gate_suh.shape[0] == 1), "up_suh_shared": int(pack.up_suh.shape[0] == 1),
            "down_svh_shared": int(pack.down_svh.shape[0] == 1), "m": plan.m, "top_k": plan.top_k,
            "ids_int64": int(topk_ids.dtype == torch.int64), "x_dtype": _X_DTYPES[x.dtype],
            "out_dtype": _OUT_DTYPES[out.dtype], "m_tile": plan.m_tile, "k_split": plan.k_split,
            "slot_capacity": plan.slot_capacity, "tile_capacity": plan.tile_capacity,
            "direct": int(plan.direct), "fc1_tail_split": plan.fc1_tail_split,
        }
        for name, value in scalars.items():
            setattr(a, name, int(value))
        return a
