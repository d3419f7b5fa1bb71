"""Where `trellis repack` sends exl3-v1 work: TR3 -> exl3-v1 (from_tr3.py), exl3-v1 -> TR3 (to_tr3.py) and
exl3-v1 -> route pack (to_route_pack.py)."""

from __future__ import annotations

from pathlib import Path

from trellis_cli.checkpoint.model import DIALECT_EXL3V1, DIALECT_TR3_PER_EXPERT, DIALECT_TR3_SHARED_H, Checkpoint
from trellis_cli.errors import UsageError
from trellis_cli.repack.result import Validator, check_source


def handles(checkpoint: Checkpoint, to: str) -> bool:
    return checkpoint.dialect == DIALECT_EXL3V1 or to == "exl3-v1"


def run_exl3v1_repack(checkpoint: Checkpoint, out: Path, options, validator: Validator, **progress):
    if checkpoint.dialect == DIALECT_EXL3V1:
        if options.to == "exl3-v1":
            raise UsageError("the source is already exl3-v1: --to exl3-v1 is not a conversion of it; use --to tr3 "
                             "or --to route-pack")
        if options.to == "route-pack":
            from trellis_cli.repack.exl3v1.to_route_pack import exl3v1_to_route_pack

            return exl3v1_to_route_pack(checkpoint, out, options, validator, **progress)
        from trellis_cli.repack.exl3v1.to_tr3 import exl3v1_to_tr3

        return exl3v1_to_tr3(checkpoint, out, options, validator, **progress)
    if checkpoint.dialect not in (DIALECT_TR3_PER_EXPERT, DIALECT_TR3_SHARED_H):
        raise UsageError(f"--to exl3-v1 reads rank-sliced TR3 checkpoints; the source is {checkpoint.dialect}")
    from trellis_cli.repack.exl3v1.from_tr3 import preflight_exl3v1, tr3_to_exl3v1

    preflight_exl3v1(checkpoint, out, options)  # options, OUT, free space: before the validation
    if options.validate:
        check_source(checkpoint, validator)
    return tr3_to_exl3v1(checkpoint, out, options, validator, **progress)
