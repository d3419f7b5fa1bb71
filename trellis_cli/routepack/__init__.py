"""A route-pack directory as readers see it: manifest.py (manifest.json written canonically with its self hash,
and read back), manifest_shape.py (the manifest's structure, checked before anything reads it) and verify.py
(the whole directory against the manifest, as findings). The layout itself is formats/route_pack.py.

Shared by validate, inspect, bench and repack; imports none of them.
"""
