"""Where `trellis repack` sends exl3-v1 work: TR3 -> exl3-v1 (from_tr3.py), exl3-v1 -> TR3 (to_tr3.py) and
exl3-v1 -> route pack (to_route_pack.py), BTX <-> exl3-v1 (rename.py). Which driver runs is the dialect registry's conversion table."""

from __future__ import annotations

from pathlib import Path

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.repack.result import Validator, check_source

DRIVERS = ("tr3-to-exl3-v1", "exl3-v1-to-tr3", "exl3-v1-to-route-pack", "btx-to-exl3-v1", "exl3-v1-to-btx")


def run_exl3v1_repack(driver: str, checkpoint: Checkpoint, out: Path, options, validator: Validator, **progress):
    if driver in ("btx-to-exl3-v1", "exl3-v1-to-btx"):
        from trellis_cli.repack.exl3v1.rename import rename_repack

        return rename_repack(driver, checkpoint, out, options, validator, **progress)
    if driver == "exl3-v1-to-route-pack":
        from trellis_cli.repack.exl3v1.to_route_pack import exl3v1_to_route_pack

        return exl3v1_to_route_pack(checkpoint, out, options, validator, **progress)
    if driver == "exl3-v1-to-tr3":
        from trellis_cli.repack.exl3v1.to_tr3 import exl3v1_to_tr3

        return exl3v1_to_tr3(checkpoint, out, options, validator, **progress)
    from trellis_cli.repack.exl3v1.from_tr3 import preflight_exl3v1, tr3_to_exl3v1

    preflight_exl3v1(checkpoint, out, options)  # options, OUT, free space: before the validation
    if options.validate:
        check_source(checkpoint, validator)
    return tr3_to_exl3v1(checkpoint, out, options, validator, **progress)
