"""The byte formats, at the bottom of the layers and torch-free: the route-pack layout (route_pack.py) and the
byte layout every safetensors shard must have (safetensors_layout.py); exl3-v1's schema and byte arithmetic live
in its dialect (dialects/exl3v1/schema.py, layout.py). They import only errors, findings, header, codebooks and
id_ranges, so the kernel, the reference forward and every reader can depend on them alone.
"""
