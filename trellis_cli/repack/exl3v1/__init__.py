"""The repack drivers that read or write exl3-v1: dispatch.py (which one `trellis repack` runs), from_tr3
(TR3 -> exl3-v1), to_tr3 (exl3-v1 -> TR3), to_route_pack (exl3-v1 -> route pack) with its read-back check
pack_readback, pack (a layer's TP extent as a LayerPack) and carry (the files around the experts).
"""
