"""trellis: a toolchain for mixed-bitrate EXL3 ("trellis") Mixture-of-Experts checkpoints.

The library API (docs/architecture.md, "Library API"); every name is imported on first use, so
`import trellis_cli` loads nothing else, and torch only with what needs it:

    source = open_source("org/name@rev")           # or a local path; None is the bundled sample
    checkpoint = open_checkpoint(source)             # the normalized, torch-free model of the checkpoint
    report = run_validation(checkpoint, deep=True)   # Report of Findings; report.ok (the dialect's default engine)
    report = validate_source(source, ValidateRequest(deep=True))   # the same, opening included: `trellis validate`
    document = inspect_source(source, InspectRequest(tp=4))        # `trellis inspect --tp 4`; .to_json()
    result = run_repack(checkpoint, "OUT", RepackOptions(tp=4))
    result = fit_source(source, FitRequest(tp=4, gpu=choose_gpu("rtx-pro-6000", None)))   # `trellis fit`
    result = diff_sources(source, open_source("OUT"))   # `trellis diff`; .identical, .to_dict()
    result = bench_run(BenchRequest(synthetic="glm52-tp4", smoke=True))   # `trellis bench --smoke`
    moe = FusedMoe(read_layer_pack("OUT", layer=3, rank=0))   # needs a CUDA GPU
    y = moe.forward(x, topk_ids, topk_weights)

Expected failures raise `TrellisError` subclasses (trellis_cli.errors), never print or exit.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "open_source": "trellis_cli.sources",
    "Source": "trellis_cli.sources",
    "open_checkpoint": "trellis_cli.dialects.open",
    "read_tensor": "trellis_cli.checkpoint.tensors",
    "Checkpoint": "trellis_cli.checkpoint.model",
    "run_validation": "trellis_cli.validate",
    "validate_source": "trellis_cli.validate.request",
    "ValidateRequest": "trellis_cli.validate.request",
    "inspect_source": "trellis_cli.inspect_request",
    "InspectRequest": "trellis_cli.inspect_request",
    "InspectDocument": "trellis_cli.inspect_request",
    "Report": "trellis_cli.findings",
    "Finding": "trellis_cli.findings",
    "Severity": "trellis_cli.findings",
    "run_repack": "trellis_cli.workflows",
    "RepackOptions": "trellis_cli.repack.run",
    "RepackResult": "trellis_cli.dialects.conversion",
    "LayerPack": "trellis_cli.formats.layer_pack",
    "read_layer_pack": "trellis_cli.dialects",
    "run_diff": "trellis_cli.diff.run",
    "diff_sources": "trellis_cli.diff.run",
    "fit_source": "trellis_cli.fit.run",
    "FitRequest": "trellis_cli.fit.run",
    "FitResult": "trellis_cli.fit.run",
    "choose_gpu": "trellis_cli.fit.gpus",
    "bench_run": "trellis_cli.bench.run",
    "BenchRequest": "trellis_cli.bench.request",
    "DiffResult": "trellis_cli.diff.result",
    "FusedMoe": "trellis_cli.kernel.launch",
    "TrellisError": "trellis_cli.errors",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on demand
    from trellis_cli.bench.request import BenchRequest
    from trellis_cli.bench.run import bench_run
    from trellis_cli.checkpoint.model import Checkpoint
    from trellis_cli.dialects.open import open_checkpoint
    from trellis_cli.checkpoint.tensors import read_tensor
    from trellis_cli.diff.result import DiffResult
    from trellis_cli.diff.run import diff_sources, run_diff
    from trellis_cli.errors import TrellisError
    from trellis_cli.findings import Finding, Report, Severity
    from trellis_cli.fit.gpus import choose_gpu
    from trellis_cli.fit.run import FitRequest, FitResult, fit_source
    from trellis_cli.formats.layer_pack import LayerPack
    from trellis_cli.inspect_request import InspectDocument, InspectRequest, inspect_source
    from trellis_cli.kernel.launch import FusedMoe
    from trellis_cli.dialects import read_layer_pack
    from trellis_cli.dialects.conversion import RepackResult
    from trellis_cli.repack.run import RepackOptions
    from trellis_cli.sources import Source, open_source
    from trellis_cli.validate import run_validation
    from trellis_cli.validate.request import ValidateRequest, validate_source
    from trellis_cli.workflows import run_repack


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trellis_cli' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
