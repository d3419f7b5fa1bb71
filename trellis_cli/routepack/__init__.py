"""The route pack below the dialects, where bench and every conversion reach it: the packer that makes a
checkpoint's (layer, rank) a LayerPack (pack.py, plan.py, source_bytes.py, compare.py, carry.py: what every
dialect's `layer_pack` and every repack driver use), one layer file written and read (layer_file.py) and
manifest.json written canonically with its self hash and read back (manifest.py). The layer layout itself is
formats/route_pack.py (the kernel's contract); the route pack as a checkpoint and as a conversion target (the
manifest's shape, the directory's verification, its writer, its read-back) is dialects/routepack/.

Shared by validate, inspect, bench and repack; imports none of them.
"""
