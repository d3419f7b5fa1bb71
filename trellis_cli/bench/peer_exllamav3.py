"""exllamav3's own MoE layer, built from a route pack's tensors, for `trellis bench --compare exllamav3`.

The peer is imported, never re-implemented: its `BlockSparseMLP` module runs the layer, through whichever of
its kernels it picks for the batch size. Its MoE kernels take one K per projection, so a mixed layer becomes
one peer module per tier, holding that tier's experts; a route to another tier's expert is given an id
outside the module's expert range, which the peer masks (contributes zero), as it does for an expert-range
shard under tensor parallelism.

Narrow import: the package's top-level `__init__` (and those of its `model` and `tokenizer` subpackages)
import the tokenizer, generator and sampler stacks and their dependencies (tokenizers, llguidance, ...),
none of which the MoE layer uses. Those three packages are registered as bare package shells, so only the
MoE layer's own import closure runs: torch, triton, numpy, pydantic, rich, typing_extensions, and ninja to
build the peer's CUDA extension on first import (minutes; cached afterwards).

The expert tensors need no conversion: a TR3 expert projection is an EXL3 linear, and a route pack keeps
each one's trellis bytes unchanged (docs/format.md), so the peer's linears are views of the pack's tensors.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass

import torch

from trellis_cli.codebooks import MARKERS
from trellis_cli.formats.layer_pack import LayerPack
from trellis_cli.reference import Projection, pack_expert

PEER = "exllamav3"
PEER_VERSION = "1.6.5"  # the release these calls are written against
INSTALL_HINT = f"pip install {PEER}=={PEER_VERSION}"
_SHELLS = ("", ".model", ".tokenizer")  # packages whose __init__ is skipped


@dataclass(frozen=True)
class PeerApi:
    """The peer's classes this comparison calls."""

    version: str
    block_sparse_mlp: type  # exllamav3.modules.block_sparse_mlp.BlockSparseMLP
    linear: type  # exllamav3.modules.linear.Linear
    linear_exl3: type  # exllamav3.modules.quant.exl3.LinearEXL3
    max_bszn: int  # batch sizes up to this run its fused decode kernels (no host sync)


@dataclass(frozen=True)
class PeerLocation:
    version: str
    root: str  # the package directory


def locate_peer() -> PeerLocation | str:
    """Where the peer is installed, or a one-line reason why it is not usable; cheap (imports nothing)."""
    try:
        spec = importlib.util.find_spec(PEER)
    except (ImportError, ValueError) as err:
        return f"{PEER} cannot be located ({err})"
    if spec is None or not spec.submodule_search_locations:
        return f"{PEER} is not installed ({INSTALL_HINT})"
    try:
        version = importlib.metadata.version(PEER)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version != PEER_VERSION:
        return f"{PEER} {version} is installed; this comparison calls {PEER_VERSION} ({INSTALL_HINT})"
    return PeerLocation(version, list(spec.submodule_search_locations)[0])


def load_peer(location: PeerLocation) -> PeerApi | str:
    """The peer's API (its first import builds its CUDA extension), or a one-line reason why not."""
    if not torch.cuda.is_available():
        return f"{PEER} runs on a CUDA GPU and none is visible"
    try:
        return _import_moe(location.version, location.root)
    except ModuleNotFoundError as err:
        return f"its MoE layer needs the module {err.name!r}, which is not installed"
    except Exception as err:  # the peer's extension build or import failing, whatever it raises
        last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        return f"importing its MoE layer failed: {type(err).__name__}: {last[:300]}"


def package_shell(name: str, path: str) -> types.ModuleType:
    """A package module whose `__init__` never runs: its submodules import from `path`. It carries a spec,
    so that `importlib.util.find_spec(name)` (locate_peer) still answers once it sits in sys.modules."""
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [path]
    return importlib.util.module_from_spec(spec)  # __path__ from the spec's search locations


def _import_moe(version: str, root: str) -> PeerApi:
    added = []
    if PEER not in sys.modules:  # a full import already done by the host is used as it is
        for suffix in _SHELLS:
            sys.modules[PEER + suffix] = package_shell(PEER + suffix, root + suffix.replace(".", "/"))
            added.append(PEER + suffix)
    try:
        config = importlib.import_module(f"{PEER}.model.config")
        if not hasattr(sys.modules[f"{PEER}.model"], "Config"):
            setattr(sys.modules[f"{PEER}.model"], "Config", config.Config)  # what `from ..model import Config` reads
        bsm = importlib.import_module(f"{PEER}.modules.block_sparse_mlp")
        linear = importlib.import_module(f"{PEER}.modules.linear")
        exl3 = importlib.import_module(f"{PEER}.modules.quant.exl3")
    except BaseException:
        for name in [n for n in sys.modules if n == PEER or n.startswith(PEER + ".")]:
            if added:
                del sys.modules[name]
        raise
    return PeerApi(version, bsm.BlockSparseMLP, linear.Linear, exl3.LinearEXL3, int(bsm.MAX_BSZN))


def tier_experts(pack: LayerPack, tier: int) -> list[tuple[Projection, Projection, Projection]]:
    """(gate, up, down) of each expert of one tier, in local-id order, as (trellis, suh, svh) views of the
    pack: the per-linear tensors an EXL3 checkpoint stores (docs/exl3-format.md §1)."""
    start = sum(pack.tier_size[:tier])
    return [pack_expert(pack, start + local) for local in range(pack.tier_size[tier])]


def split_routes(pack: LayerPack, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per tier: the routes as that tier's peer module takes them, (int64 local ids, fp16 weights) [M, k].

    A route to an expert of another tier, or to one this rank does not serve, keeps its slot and weight but
    gets the id E_t (one past the tier's local ids), outside the module's expert range: the peer drops it."""
    g2c = pack.global_to_combined.to(topk_ids.device).long()
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < g2c.numel())
    combined = torch.where(valid, g2c[ids.clamp(0, g2c.numel() - 1)], -1)
    out, start = [], 0
    for size in pack.tier_size:
        local = combined - start
        mine = (combined >= 0) & (local >= 0) & (local < size)
        out.append((torch.where(mine, local, size).contiguous(), topk_weights.to(torch.float16).contiguous()))
        start += size
    return out


class _RouteFeed:
    """The module's TP backend hook: a module without a router receives its selection by broadcast; this
    one copies in the routes of the next call instead."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.weights: torch.Tensor | None = None

    def broadcast(self, tensor: torch.Tensor, src_device=None) -> None:
        routes = self.ids if tensor.dtype == torch.long else self.weights
        assert routes is not None, "the routes are set before each call"
        tensor.copy_(routes)


class PeerTier:
    """One tier of the layer as an exllamav3 BlockSparseMLP: `forward(x fp16 [M, H])` -> fp32 [M, H]."""

    def __init__(self, api: PeerApi, pack: LayerPack, tier: int, top_k: int, num_experts: int) -> None:
        device = pack.tier_trellis[tier].device
        self.tier, self.k, self.experts = tier, pack.tier_k[tier], pack.tier_size[tier]
        marker = MARKERS[pack.codebook]
        flags: dict[str, torch.Tensor | None] = {"mcg": None, "mul1": None}
        if marker is not None:
            flags[marker[0]] = torch.tensor(marker[1], dtype=torch.int32)
        gates, ups, downs = [], [], []
        for local, (gate, up, down) in enumerate(tier_experts(pack, tier)):
            key = f"trellis.tier{tier}.experts.{local}"
            gates.append(self._linear(api, f"{key}.gate_proj", gate, flags, torch.half, device))
            ups.append(self._linear(api, f"{key}.up_proj", up, flags, torch.half, device))
            downs.append(self._linear(api, f"{key}.down_proj", down, flags, torch.float, device))
        self.feed = _RouteFeed()
        self.module = api.block_sparse_mlp(
            config=None, key=f"trellis.tier{tier}", hidden_size=pack.hidden, intermediate_size=pack.intermediate,
            num_experts=num_experts, num_experts_per_tok=top_k, num_local_experts=self.experts,
            gates=gates, ups=ups, downs=downs, routing_first=0, routing_last=self.experts,
            routing_device=device, interm_dtype=torch.half, out_dtype=torch.float, activation_fn="silu")
        self.module.device = device
        self.module.load_local()
        self.params = {"backend": self.feed}

    @staticmethod
    def _linear(api: PeerApi, key: str, projection: Projection, flags: dict, out_dtype, device):
        trellis, suh, svh = projection
        rows, cols = int(suh.shape[0]), int(svh.shape[0])
        linear = api.linear(config=None, key=key, in_features=rows, out_features=cols, out_dtype=out_dtype)
        linear.device = device
        linear.inner = api.linear_exl3(None, rows, cols, None, None, None, suh, svh, trellis, flags["mcg"],
                                       flags["mul1"], None, out_dtype, key=key)
        linear.quant_type = "exl3"
        return linear

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        self.feed.ids, self.feed.weights = ids, weights
        return self.module.forward(x, self.params)


def peer_layer(api: PeerApi, pack: LayerPack, top_k: int) -> list[PeerTier]:
    """The layer as one peer module per tier (views of the pack's tensors: keep the pack alive)."""
    num_experts = int(pack.global_to_combined.shape[0])
    return [PeerTier(api, pack, tier, top_k, num_experts) for tier in range(len(pack.tier_k))]
