"""The global route/descriptor layout the fused kernel reads, and the repack that writes it.

Public entry points: `pack_layer` (checkpoint -> LayerPack in memory), `write_layer_pack` /
`read_layer_pack` (one layer file), `run_repack` (the whole streamed, verified directory),
`verify_repacked` / `describe_repacked` (validate / inspect of a repacked directory).
"""

from trellis_cli.repack.format import LayerPack
from trellis_cli.repack.layer_file import read_layer_pack, write_layer_pack
from trellis_cli.repack.pack import pack_layer
from trellis_cli.repack.run import RepackOptions, run_repack
from trellis_cli.repack.verify import describe_repacked, verify_repacked

__all__ = ["LayerPack", "RepackOptions", "describe_repacked", "pack_layer", "read_layer_pack", "run_repack",
           "verify_repacked", "write_layer_pack"]
