"""`trellis repack SOURCE OUT`: any conversion of the dialect registry's table, from a TR3, exl3-v1, BTX, route-pack
or GLM-5.3 stream SOURCE (--to route-pack by default; tr3, exl3-v1, btx, glm53-stream), streamed, verified,
resumable; or its dry run (the conversion's plan, nothing written)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from trellis_cli.cli import output
from trellis_cli.cli.options import (CacheDirOpt, EndpointOpt, OfflineOpt, RevisionOpt, TokenOpt, open_cli_source,
                                     parse_layers)
from trellis_cli.errors import TrellisError, UsageError

if TYPE_CHECKING:
    from trellis_cli.dialects.conversion import DryRunPlan, RepackResult
    from trellis_cli.repack.run import RepackOptions


HELP = (
    "Convert a checkpoint to another layout of the dialect registry's table: by default a rank-sliced TR3 (or "
    "exl3-v1) checkpoint into the route-pack layout the fused kernel reads directly (one file per MoE layer and "
    "TP rank: tier-ordered trellis slabs, descriptors, rotation tables; docs/format.md); --to tr3, exl3-v1, btx "
    "or glm53-stream for the others (below).\n\n"
    "Which target for what: the default route pack is for the bundled kernel (`trellis bench`) and loads in no "
    "serving engine; the vLLM fork loads --to tr3 (with --tp N, the TP the server runs), b12x loads "
    "--to exl3-v1.\n\n"
    "Built in OUT.partial and moved into place only when every file was read back and matched its source "
    "bit for bit; rerunning after an interruption resumes. --tp re-slices and --shared-h collapses "
    "hidden-side rotations only where that is exact, and refuses otherwise.\n\n"
    "--to exl3-v1 writes b12x's slot-major container from TR3 (refused, before anything is written, unless "
    "every rank's hidden-side vectors are byte-identical); an exl3-v1 SOURCE repacks into a route pack, or "
    "converts back with --to tr3, at any --tp its slot layout allows. --to btx writes an exl3-v1 container under "
    "b12x 1.3.0's names (BTX), and a BTX SOURCE converts back with --to exl3-v1.\n\n"
    "A GLM-5.3 unsliced stream (scope glm53_routed_experts_only) converts to TR3 rank slices with --to tr3 "
    "--tp N (any N whose intermediate slice is whole 128-channel blocks), and such a TR3 back with --to "
    "glm53-stream, bit for bit.\n\n"
    "Examples:\n\n"
    "  trellis repack ./GLM-TR3 ./GLM-TR3-route-pack --jobs 4   (for trellis bench)\n\n"
    "  trellis repack ./GLM-TR3 ./GLM-TR3-tp8 --to tr3 --tp 8   (the vLLM fork at TP 8)\n\n"
    "  trellis repack ./GLM-TR3 ./GLM-exl3v1 --to exl3-v1   (b12x)\n\n"
    "  trellis repack org/model@main ./packed --layers 3-5 --ranks 0\n\n"
    "  trellis repack ./packed ./GLM-TR3-again --to tr3"
)


def repack_command(
    source: Annotated[str, typer.Argument(
        help="TR3 checkpoint (a directory, or a Hub id org/name or org/name@rev), a route pack, an exl3-v1 or "
             "BTX checkpoint, or a GLM-5.3 unsliced stream.")],
    out: Annotated[Path, typer.Argument(help="Output directory (must not exist or be empty).")],
    revision: RevisionOpt = None,
    token: TokenOpt = None,
    offline: OfflineOpt = False,
    endpoint: EndpointOpt = None,
    cache_dir: CacheDirOpt = None,
    layers: Annotated[Optional[str], typer.Option(help="MoE layers to repack, e.g. 3-5,40 (default all).")] = None,
    ranks: Annotated[Optional[str], typer.Option(help="TP ranks to write, e.g. 0,1 (default all).")] = None,
    tp: Annotated[Optional[int], typer.Option(help="Target TP degree (exact re-slicing only).")] = None,
    shared_h: Annotated[bool, typer.Option("--shared-h", help="Collapse hidden-side rotations to one row "
                                                              "(refused unless byte-equal).")] = False,
    # The targets are the dialect registry's (checked by the library, which names the word a `--to` spelled
    # another way, `routepack`, meant).
    to: Annotated[str, typer.Option("--to", help="Output layout: route-pack, tr3, exl3-v1, btx or "
                                                 "glm53-stream.")] = "route-pack",
    jobs: Annotated[int, typer.Option("--jobs", "-j", help="Layer-ranks processed in parallel (each holds "
                                                             "one layer-rank, ~1 GB at GLM-5.2 TP4).")] = 4,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace a non-empty OUT.")] = False,
    experts_only: Annotated[bool, typer.Option("--experts-only", help="Do not carry non-expert files and "
                                                                      "tensors through.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would be written (files, bytes, free "
                                                            "space, the conversion) and what would be "
                                                            "refused; write nothing, validate nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
) -> None:
    from trellis_cli.repack.run import RepackOptions

    started = time.perf_counter()  # the summary's time covers opening, validating and planning too
    # --layers / --ranks typed once here: the syntax and id bound validate and inspect use (an empty text or
    # 0-99999999999 is a usage error before the source is opened)
    chosen_layers, chosen_ranks = parse_layers(layers), parse_layers(ranks, "--ranks")
    check_arguments(source, out, tp, jobs, overwrite, to)
    options = RepackOptions(layers=chosen_layers, ranks=chosen_ranks, tp=tp, shared_h=shared_h, to=to, jobs=jobs,
                            overwrite=overwrite, copy_other=not experts_only,
                            dry_run=dry_run)
    opened = open_cli_source(source, revision, token, offline, endpoint, cache_dir)
    # A plain line even off a terminal: opening and validating a 300 GB source reads ~80 headers first.
    output.log(f"opening {opened.description}: " + (
        "reading headers (dry run: nothing is validated or written) ..." if dry_run else
        "reading headers and validating it before writing (OUT and free space are checked first) ..."))
    result = _run(opened, out, options, as_json)
    if result.plan is not None:
        _print_plan(result.plan, as_json)
        return
    _print_summary(result, options, source, time.perf_counter() - started, as_json)


def check_arguments(source: str, out: Path, tp: int | None, jobs: int, overwrite: bool, to: str = "route-pack") -> None:
    """Usage errors found before the source is opened (which can take a minute on a production checkpoint)."""
    from trellis_cli.dialects import registry
    from trellis_cli.repack.run import unknown_target

    if to not in registry.targets():
        raise UsageError(unknown_target(to))
    if tp is not None and tp < 1:
        raise UsageError(f"--tp {tp}: must be at least 1 (leave it out to keep the source's TP)")
    if jobs < 1:
        raise UsageError(f"--jobs {jobs}: must be at least 1")
    local = Path(source).expanduser()
    if local.is_dir():  # a Hub source has no local root to overlap; OUT is still checked again before writing
        from trellis_cli.repack.staging import check_target

        check_target(out, local, overwrite)


def _run(opened, out: Path, options, as_json: bool):
    from trellis_cli.errors import ValidationFailed
    from trellis_cli.workflows import run_repack

    enabled = output.progress_enabled(as_json)
    with output.make_progress(bytes_mode=True, enabled=enabled) as progress:
        stage = output.stage_advancer(progress)  # opening and validating the source, then the bytes written
        task = progress.add_task("repack (bytes)", total=None, visible=False)  # shown once its total is known

        def total(n: int) -> None:
            progress.update(task, total=n, visible=True)

        try:
            return run_repack(opened, out, options, on_bytes=lambda n: progress.advance(task, n),
                              on_total=total, log=output.log, on_stage=stage)
        except OSError as err:
            raise _write_failed(err, out) from err
        except ValidationFailed as err:
            if as_json:  # a machine reader gets the refusal and every finding, not only the stderr line
                from trellis_cli.cli.validate_cmd import emit_report_json

                emit_report_json(err.report, refused="the source does not validate; nothing was written")
            raise
        except KeyboardInterrupt:
            _say_where_the_stage_is(out)
            raise


def _say_where_the_stage_is(out: Path) -> None:
    """After Ctrl-C: where the verified part is, how big, and how to resume it."""
    from trellis_cli.repack.staging import stage_path, staged_files

    stage = stage_path(out)
    if not stage.is_dir():
        return
    files, size = staged_files(out)
    output.print_line(f"{stage} keeps {files} verified file(s), {size / 1e9:.2f} GB: rerun the same command to "
                      f"resume (other options, or a changed source, start over and discard them; delete {stage} "
                      f"to free the space)", err=True)


def _print_plan(plan: DryRunPlan, as_json: bool) -> None:
    """--dry-run: what a run would write and whether it would be refused; exit 1 on a refusal."""
    from trellis_cli.errors import CheckFailed

    if as_json:
        output.emit_json({"dry_run": True, **plan})
    else:
        files, needed = plan["files"], plan["bytes_needed"]
        output.print_line(f"dry run: {plan['conversion']} into {plan['out']}; nothing written")
        layer_files = sum(1 for f in files if f["name"].startswith("layer-"))
        output.print_line(f"  files     {len(files)}" + (f" ({layer_files} layer file(s))" if layer_files else ""))
        output.print_line(f"  bytes     {needed / 1e9:.2f} GB to hold, {plan['bytes_resumable'] / 1e9:.2f} GB of it "
                          f"already staged")
        output.print_line(f"  free      {plan['free_bytes'] / 1e9:.2f} GB on OUT's filesystem"
                          + (" (enough)" if plan["space_ok"] else " (NOT enough)"))
        for note in plan["notes"]:
            output.print_line(f"  note      {note}")
    if plan["refusals"]:
        raise CheckFailed("dry run: a real run would be refused: " + "; ".join(plan["refusals"]))


def _print_summary(result: RepackResult, options: RepackOptions, source: str, seconds: float, as_json: bool) -> None:
    # Verified means every output byte equals its source byte; it says nothing of whether the values are sound.
    note = f"tensor values not checked (`trellis validate {source} --deep` checks them)"
    summary = result.summary(options.to, seconds, [note])
    if as_json:
        output.emit_json(summary.to_json())
        return
    output.print_line(
        f"wrote {summary.out} ({options.to}): {result.files_written} file(s) written and verified against the "
        f"source bit for bit, {result.files_resumed} resumed, {result.bytes_written:,} bytes in {summary.seconds} s "
        f"({round(seconds - result.seconds, 1)} s of it opening, validating and planning); {note}")


def _write_failed(err: OSError, out: Path) -> TrellisError:
    """An I/O error (disk full, permission denied) keeps OUT.partial and its record of verified files, so
    the message says how to continue rather than only what broke."""
    from trellis_cli.repack.staging import STAGE_SUFFIX

    stage = out.absolute().with_name(out.name + STAGE_SUFFIX)
    message = output.describe_os_error(err)
    if stage.is_dir():
        message += f" (the partial output {stage} is kept: fix the cause and rerun the same command to resume)"
    return TrellisError(message)
