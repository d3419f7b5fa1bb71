"""R7's own rules: its per-projection K maps (`r7_routed_experts`), and the eager start its metadata gets from
vLLM's EXL3 loader. Run by the R7 dialect's `check`, beside validate's shared shard rules."""

from __future__ import annotations

from typing import Iterator

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.findings import Finding, Location, warning
from trellis_cli.header import is_int

R7_K_VALUES = {3, 4, 5}
R7_LAYER_SUM = 2688  # 768 entries averaging 3.5 bits
# The fork's R7 loader (quantization/exl3.py, stored version of 212,886 chars) never opens bit_map_manifests: each
# K comes from the trellis shape (Exl3MoEMethod._prepare_r7_graph_weights, _r7_projection_tiers).
R7_MAPS_NOT_READ = ("no loader reads the R7 bit maps (each K comes from the trellis shape), so it loads as "
                    "stored; regenerate the map from the shapes so tools that read it agree")


def check_r7_maps(ckpt: Checkpoint) -> Iterator[Finding]:
    """A malformed R7 bit map is reported, as a warning: no loader reads these maps (the R7 loader and exllamav3
    take each K from the trellis shape), so the checkpoint loads as stored; the map is still wrong."""
    for li, layer in ckpt.layers.items():
        pk = layer.declared_projection_k
        if pk is None:
            continue
        where = Location(file=ckpt.k_source.get(li), layer=li)
        if ckpt.num_experts and len(pk) != 3 * ckpt.num_experts:
            yield warning("bitmap.length", where, "R7 map needs one K per (expert, projection); "
                          f"{R7_MAPS_NOT_READ}", expected=3 * ckpt.num_experts, found=len(pk))
        bad = sorted({repr(k) for k in pk.values() if not (is_int(k) and k in R7_K_VALUES)})
        if bad:
            yield warning("bitmap.k-value", where, f"R7 K values must be 3, 4 or 5; {R7_MAPS_NOT_READ}",
                          expected=sorted(R7_K_VALUES), found=bad[:8])
        elif ckpt.num_experts == 256 and sum(pk.values()) != R7_LAYER_SUM:
            yield warning("bitmap.r7-sum", where, "R7 3.5 bpw layers sum to 2688 bits", expected=R7_LAYER_SUM,
                          found=sum(pk.values()))


def check_eager(ckpt: Checkpoint) -> Iterator[Finding]:
    """The vLLM fork lets only hybrid_tr3_tail checkpoints run with CUDA graphs; R7 metadata is not that."""
    yield warning("runtime.eager", Location(file="config.json", tensor="quantization_config.r7_routed_experts"),
                  "R7 metadata is not the hybrid_tr3_tail contract that vLLM's EXL3 loader exempts from its "
                  "eager check: without a build that adds r7_routed_experts to that exemption the server "
                  "runs eager (no CUDA graph capture, several times slower decode) and says nothing",
                  expected="hybrid_tr3_tail (format exl3-trellis)", found="r7_routed_experts")
