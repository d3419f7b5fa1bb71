"""The checkpoint model: dialect detection and a normalized, lazy description of a checkpoint.

Entry points: `open_checkpoint(source)` (checkpoint/open.py) and `read_tensor(checkpoint, ref)`
(checkpoint/tensors.py). Imported lazily so that `import trellis_cli.checkpoint.model` stays cheap.
"""

from __future__ import annotations


def open_checkpoint(source):  # noqa: D103 - thin re-export
    from trellis_cli.checkpoint.open import open_checkpoint as _open

    return _open(source)


def read_tensor(checkpoint, ref):  # noqa: D103 - thin re-export
    from trellis_cli.checkpoint.tensors import read_tensor as _read

    return _read(checkpoint, ref)
