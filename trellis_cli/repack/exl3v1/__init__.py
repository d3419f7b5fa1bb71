"""The repack drivers that read or write exl3-v1 (repack/drivers.py picks them from the registry's conversion
table): from_tr3 (TR3 -> exl3-v1), to_tr3 (exl3-v1 -> TR3), to_route_pack (exl3-v1 -> route pack) with its
read-back check pack_readback, rename (BTX <-> exl3-v1), and carry (the files around the experts).
"""
