"""`trellis diff`: what differs between two checkpoints, in the logical units of the normalized model.

`run_diff(a, b, layers=...) -> DiffResult` (diff/run.py); units per dialect in diff/units.py, content identity
cheapest first in diff/hashing.py, declarations key by key in diff/structure.py, the result in diff/result.py.
Nothing here prints: the CLI renders the result.
"""

from __future__ import annotations


def run_diff(a, b, **kwargs):  # noqa: D103 - thin re-export, imported on first use
    from trellis_cli.diff.run import run_diff as _run

    return _run(a, b, **kwargs)
