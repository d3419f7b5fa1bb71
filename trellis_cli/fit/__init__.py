"""`trellis fit`: will a checkpoint fit on given GPUs at a given context, from headers and configs only.

One module per concept, data flowing one way: `gpus` (memory presets and sizes), `arch` (the model config's
MLA / DSA fields), `sharding` (which tensors an engine slices by TP and how), `weights` (exact bytes per rank
from headers), `kv` (KV cache bytes per token), `reserve` (the runtime reserve's named terms), `remedies`
(what would make it fit), and `run` (`fit(request) -> FitResult`, the one entry point). Nothing here prints.
"""
