"""The checkpoint model: a normalized, lazy description of a checkpoint, whatever its dialect.

Entry point here: `read_tensor(checkpoint, ref)` (checkpoint/tensors.py). Opening a checkpoint is the
dialects' job (`trellis_cli.dialects.open_checkpoint`). Imported lazily so that `import
trellis_cli.checkpoint.model` stays cheap.
"""

from __future__ import annotations


def read_tensor(checkpoint, ref):  # noqa: D103 - thin re-export
    from trellis_cli.checkpoint.tensors import read_tensor as _read

    return _read(checkpoint, ref)
