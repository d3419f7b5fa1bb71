"""The `exl3-v1` MoE container: `exl3-manifest.json` plus one safetensors file per MoE layer, experts stored
slot-major (32 intermediate channels per slot), one set of hidden-side tables per layer.

Modules, in the order data flows: schema (the manifest, parsed strictly into findings), layout (byte
arithmetic of rows, bundles, planes and TP extents), container (the layer files' headers and small tables),
pack (a layer's TP extent as a route-pack LayerPack), write (layer files and the manifest), synth (synthetic
checkpoints), repack (where `trellis repack` sends exl3-v1 work): from_tr3, to_tr3, to_route_pack with its
read-back check pack_readback, and carry (the files around the experts). docs/checkpoint-dialects.md
describes the container.
"""
