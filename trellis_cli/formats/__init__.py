"""The byte formats, at the bottom of the layers and torch-free: the route-pack layout (route_pack.py), the
exl3-v1 manifest schema and its byte arithmetic (exl3v1_schema.py, exl3v1_layout.py), and the byte layout every
safetensors shard must have (safetensors_layout.py). They import only errors, findings, header, codebooks and
id_ranges, so the kernel, the reference forward and every reader can depend on them alone.
"""
