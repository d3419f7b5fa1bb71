"""One eager call of the fused kernel at production shape for a profiler:

    python3 lab/perf/profile_once.py M [LIB.so]

LIB.so: a production or lab build (default: the production library of this tree, built on first use).
"""

import sys
from pathlib import Path

import torch

from trellis_cli.bench.synthetic import PRESETS, random_activations, random_routes, synthetic_pack
from trellis_cli.kernel import abi, lab
from trellis_cli.kernel.launch import FusedMoe

m = int(sys.argv[1])
lib = lab.load_any(Path(sys.argv[2])) if len(sys.argv) > 2 else abi.default_library()
moe = FusedMoe(synthetic_pack(PRESETS["glm52-tp4"], device="cuda", seed=0), lib)
x = random_activations(m, 6144, device="cuda", seed=1)
ids, w = random_routes(m, 256, 8, device="cuda", seed=2)
for _ in range(2):
    moe.forward(x, ids, w)
torch.cuda.synchronize()
