"""Writing the `exl3-v1` MoE container: write (layer files and the manifest) and synth (synthetic exl3-v1
checkpoints). Its schema and byte arithmetic are formats/exl3v1_schema.py and formats/exl3v1_layout.py; reading
it into the checkpoint model is checkpoint/exl3v1.py; converting to and from it is repack/exl3v1/.
docs/checkpoint-dialects.md describes the container.
"""
