"""`inspect_source`: one inspection from a source to its InspectDocument, the one call behind `trellis inspect`.

The checkpoint is opened once and every section the request asks for is built from it: the per-layer summary
(inspect_report.py), or every tensor (inspect_tensors.py); with `tp` the server TP's view (each rank's share
at that TP from inspect_tp.py, each engine's TP contract from validate's engines.tp_verdicts); with a GPU the
`trellis fit` section at that TP. A fit section without a TP is a usage error before anything is read, a
layer the checkpoint lacks one before any section is built; the document says what was found, the CLI's
renderers show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from trellis_cli.errors import UsageError
from trellis_cli.fit.gpus import Gpu
from trellis_cli.fit.run import FitRequest, FitResult
from trellis_cli.sources import SourceArg

if TYPE_CHECKING:
    from trellis_cli.checkpoint.model import Checkpoint
    from trellis_cli.dialects.inspect_doc import InspectSummary
    from trellis_cli.inspect_tensors import TensorListing
    from trellis_cli.inspect_tp import ServeTpView

FIT_NEEDS = "the fit section of inspect needs --tp N and --gpu NAME or --gpu-mem SIZE"


@dataclass(frozen=True)
class InspectRequest:
    layers: list[int] | None = None  # only these MoE layers (selection.parse_layer_ranges); None: all
    tensors: bool = False  # every tensor instead of the per-layer summary (no TP or fit section)
    tp: int | None = None  # the TP the server will run: K and routed bytes per rank, the engines' TP verdicts
    gpu: Gpu | None = None  # with tp: the fit section on this GPU (fit.gpus.choose_gpu)
    ctx: int | None = None  # the fit section's context length; None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        from trellis_cli.selection import require_count

        require_count(self.tp, "tp")
        require_count(self.ctx, "ctx")
        if self.gpu is not None and (not isinstance(self.gpu, Gpu) or type(self.gpu.total_bytes) is not int
                                     or self.gpu.total_bytes < 1):
            raise UsageError(f"gpu must be a Gpu (trellis_cli.fit.gpus) with total_bytes an integer of at least 1, "
                             f"got {self.gpu!r}")
        self.fit_request()  # a request that makes no sense is refused when it is made, before any reading

    def fit_request(self) -> FitRequest | None:
        """The fit section's request; a usage error when only half of what it needs is given."""
        if self.gpu is None and self.ctx is None:
            return None  # tp alone: the server TP's view, no fit section
        if self.tp is None or self.gpu is None:
            raise UsageError(FIT_NEEDS)
        from trellis_cli.fit.run import check_request

        request = FitRequest(tp=self.tp, gpu=self.gpu)  # ctx None: the model's own, FitRequest's default
        if self.ctx is not None:
            request = FitRequest(tp=self.tp, gpu=self.gpu, ctx=self.ctx)
        check_request(request)
        return request


@dataclass
class InspectProgress:
    """Where a long inspection reports: `stage(stage, done, total)` while headers are read and the model built,
    `log(line)` for what it is doing."""

    stage: Callable[[str, int, int], None] | None = None
    log: Callable[[str], None] | None = None


@dataclass
class InspectDocument:
    """What `trellis inspect` shows. `summary` (the per-layer document) or `tensors` (the listing) is set,
    as the request asked; `serve_tp` and `fit` only where it asked for them."""

    description: str  # the source, as the user named it
    dialect: str
    summary: InspectSummary | None = None
    serve_tp: ServeTpView | None = None
    fit: FitResult | None = None
    tensors: TensorListing | None = None

    @property
    def unreadable(self) -> list[dict[str, Any]]:
        """The files whose header could not be read while listing tensors (each `file` and `error`)."""
        return list(self.tensors["unreadable"]) if self.tensors is not None else []

    def to_json(self) -> dict[str, Any]:
        """The one JSON document of `trellis inspect --json`: the summary with its sections, or the listing."""
        if self.tensors is not None:
            from trellis_cli.inspect_tensors import listing_json

            return listing_json(self.tensors)
        document: dict[str, Any] = dict(self.summary or {})
        if self.serve_tp is not None:
            document["serve_tp"] = self.serve_tp
        if self.fit is not None:
            document["fit"] = self.fit.to_json()
        return document


    def json_parts(self) -> tuple[dict[str, Any], tuple[str, Iterable[Any]] | None]:
        """`to_json()` as (document, (key, items)) for a writer that streams the long array: the tensor listing's
        rows one at a time (bounded memory at any checkpoint size); None for the summary."""
        if self.tensors is None:
            return self.to_json(), None
        return {k: v for k, v in self.tensors.items() if k != "tensors"}, ("tensors", self.tensors["tensors"])


def inspect_source(source: SourceArg, request: InspectRequest | None = None,
                   progress: InspectProgress | None = None) -> InspectDocument:
    """Open `source` (a Source or a local path) once and build every section `request` asks for. Raises
    UsageError for a request that makes no sense, CheckFailed / UnknownDialect for a checkpoint that cannot
    be opened."""
    from trellis_cli.dialects import open_checkpoint
    from trellis_cli.dialects.open import require_source

    source = require_source(source)
    request = request or InspectRequest()
    progress = progress or InspectProgress()
    fit_request = request.fit_request()
    description = str(source) if isinstance(source, (str, Path)) else source.description
    if progress.log is not None:
        progress.log(f"reading headers of {description} ...")
    checkpoint = open_checkpoint(source, progress=progress.stage)
    document = InspectDocument(description=description, dialect=checkpoint.dialect)
    if request.tensors:
        from trellis_cli.checkpoint.reader import require_intact
        from trellis_cli.inspect_tensors import build_tensor_listing

        require_intact(checkpoint, "inspect --tensors")  # a listing must not leave an unreadable file out

        document.tensors = build_tensor_listing(checkpoint, request.layers)
        return document
    from trellis_cli.inspect_report import build_inspect

    document.summary = build_inspect(checkpoint, request.layers)
    if request.tp is not None:
        document.serve_tp = serve_tp_view(checkpoint, request.layers, request.tp)
    if fit_request is not None:
        import dataclasses

        from trellis_cli.fit.engines import EngineRefusal
        from trellis_cli.fit.run import fit

        try:
            document.fit = fit(checkpoint, fit_request)
        except EngineRefusal as refusal:  # inspect has no --kv-dtype: show the engine's fp8 layout, and say why
            document.fit = fit(checkpoint, dataclasses.replace(fit_request, kv_dtype="fp8"))
            document.fit.notes.insert(0, f"--kv-dtype auto is refused ({refusal.reason}); shown at fp8")
    return document


def serve_tp_view(checkpoint: Checkpoint, layers: list[int] | None, tp: int) -> ServeTpView:
    """The `serve_tp` section: the routed bytes one rank holds at TP `tp`, K per projection, and which
    engines' TP contracts accept `tp`."""
    from trellis_cli.dialects.registry import dialect_of
    from trellis_cli.inspect_tp import tp_view
    from trellis_cli.validate.engines import tp_verdicts

    chosen = list(checkpoint.layers) if layers is None else layers
    view: ServeTpView
    if not dialect_of(checkpoint).layer_files(checkpoint):  # every tensor name says its layer: what inspect_tp reads
        view = tp_view(checkpoint, chosen, tp)
    else:
        view = {"tp": tp, "layers": [], "routed_bytes_per_rank": None,
                             "note": "per-rank bytes of this container are in its own rows above"}
    view["engines"] = tp_verdicts(checkpoint, tp)
    return view
