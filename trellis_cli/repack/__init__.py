"""`trellis repack`: a checkpoint rewritten into another layout, staged, resumable and verified.

Entry points: `run_repack` (run.py; `trellis_cli.run_repack` hands it the validator), `pack_layer` (pack.py:
checkpoint -> LayerPack in memory), `write_layer_pack` / `read_layer_pack` (layer_file.py: one layer file).
Nothing is imported here, so importing one module of the package loads only what that module needs.
"""
