"""The lab build's sources: the product's kernels/ with the lab's hooks patched in (lab/kernel/cuda/hooks.patch)
and the lab's own files (lab/kernel/cuda/: lab.h, timeline.cuh, single_tu.cu) beside them. The product's
sources know nothing of the lab; a lab build compiles this staged copy through the build's one hook
(trellis_cli.kernel.build.BuildExtension, docs/kernel.md "Build extensions").

    python3 -m lab.kernel.sources stage DIR     # write the lab sources into DIR (rejected hunks as *.rej)
    python3 -m lab.kernel.sources refresh DIR   # hooks.patch := the difference from kernels/ to DIR

When a kernel change moves the lines a hook sits on so far that the patch no longer applies, the lab build
stops and names the file; then `stage` into a scratch directory, place the rejected hooks by hand, and
`refresh` from it.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trellis_cli.errors import GpuUnavailable
from trellis_cli.kernel import build

CUDA = Path(__file__).resolve().parent / "cuda"
PATCH = CUDA / "hooks.patch"


def lab_files() -> list[Path]:
    return sorted(p for p in CUDA.iterdir() if p.suffix in build.SOURCE_SUFFIXES)


def product_files() -> list[Path]:
    return sorted(p for p in build.kernel_source_dir().iterdir() if p.suffix in build.SOURCE_SUFFIXES)


def stage(into: Path, *, keep_rejects: bool = False) -> None:
    """kernels/ and the lab's files copied into `into`, hooks.patch applied there."""
    into.mkdir(parents=True, exist_ok=True)
    clash = {p.name for p in lab_files()} & {p.name for p in product_files()}
    if clash:
        raise GpuUnavailable(f"lab/kernel/cuda/ and kernels/ both hold {', '.join(sorted(clash))}")
    for path in product_files() + lab_files():
        shutil.copyfile(path, into / path.name)
    patch = shutil.which("patch")
    if patch is None:
        raise GpuUnavailable("the lab build needs the `patch` tool to place its hooks (lab/kernel/cuda/hooks.patch)")
    command = [patch, "-p1", "--batch", "--forward", "--no-backup-if-mismatch", "-d", str(into), "-i", str(PATCH)]
    done = subprocess.run(command + ([] if keep_rejects else ["--reject-file=-"]), capture_output=True, text=True)
    if done.returncode != 0:
        raise GpuUnavailable(
            f"lab/kernel/cuda/hooks.patch no longer applies to kernels/ (patch exit {done.returncode}):\n"
            f"{(done.stdout + done.stderr).strip()}\nrefresh it: python3 -m lab.kernel.sources stage DIR, place "
            f"the rejected hooks in DIR by hand, then python3 -m lab.kernel.sources refresh DIR")


def lab_source_dir() -> Path:
    """The staged lab sources, under the kernel cache, keyed by everything they are made of."""
    digest = hashlib.sha256(build.source_hash().encode())
    for path in [PATCH, *lab_files()]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    target = build.cache_dir() / "lab-sources" / digest.hexdigest()[:16]
    if (target / build.HOST_SOURCE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        stage(scratch)
        try:
            os.replace(scratch, target)
        except OSError:  # staged meanwhile by another process: theirs is the same
            if not (target / build.HOST_SOURCE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def hooks_patch(edited: Path) -> str:
    """The unified diff (-p1) from kernels/ to `edited`, over the product's files."""
    kernels, chunks = build.kernel_source_dir(), []
    for path in product_files():
        before = path.read_text().splitlines(keepends=True)
        after = (edited / path.name).read_text().splitlines(keepends=True)
        chunks += difflib.unified_diff(before, after, f"a/{path.name}", f"b/{path.name}")
    if any(not line.endswith("\n") for line in chunks):
        raise GpuUnavailable(f"a file of {kernels} or {edited} does not end with a newline")
    return "".join(chunks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m lab.kernel.sources", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=("stage", "refresh"))
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.action == "stage":
            stage(args.dir, keep_rejects=True)
        else:
            PATCH.write_text(hooks_patch(args.dir))
    except GpuUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
