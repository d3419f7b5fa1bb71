"""Is the product kernel library the same device code before and after a source change? For changes meant to
move no instruction (comments, code that compiles to nothing in the product, code moved to the lab).

    python3 lab/perf/product_identity.py --before REF [--arch sm_90,sm_120] [--codebook mcg] [--kernels k3k4]
                                         [--work DIR] [--jobs N]

Takes REF's kernels/ (`git show REF:kernels/...`) and the working tree's, and compiles every unit of the product
library (build.library_units: the working tree's unit list and flags for both sides) with the build's own command
line (build.compile_command), `-c` swapped for `-cubin`, once per arch. Per unit and arch it compares the two
cubins' ELF sections: every section that holds code or its data (.text.*, .nv.info.*, constants, symbols)
byte for byte, and ptxas's resource numbers (registers, shared memory, spills: what tests/data/kernel_resources
records); the debug sections of `-lineinfo` (named *debug*: line tables, the embedded PTX text, the source
paths) apart, since they change with every moved source line and name the source directory, and hold no
instruction. Identical code sections mean identical SASS; a kernel whose sections differ is named. Where
cuobjdump exists it also links both libraries from `-c` objects and diffs `cuobjdump -sass` of the two.

Exit 0 when every unit's code is identical, 1 when any differs, 4 without nvcc.
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from trellis_cli.errors import EXIT_FINDINGS, EXIT_GPU, TrellisError
from trellis_cli.kernel import build
from trellis_cli.kernel.jobs import Job, run_jobs
from trellis_cli.kernel.resources import parse_ptxas

SHT_NOBITS = 8
DEBUG = "debug"  # -lineinfo's sections: line numbers, PTX text and source paths, no instruction


def elf_sections(data: bytes) -> list[tuple[str, bytes]]:
    """(name, contents) of every section of a 64-bit little-endian ELF file, in file order (NOBITS: its size)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx]
    strtab = data[names[4]:names[4] + names[5]]
    sections = []
    for name_at, kind, _flags, _addr, offset, size, *_ in headers:
        name = strtab[name_at:strtab.index(b"\0", name_at)].decode()
        sections.append((name, size.to_bytes(8, "little") if kind == SHT_NOBITS else data[offset:offset + size]))
    return sections


def compare_elf(before: bytes, after: bytes, skip: tuple[str, ...] = (DEBUG,)) -> tuple[bool, list[str]]:
    """(whether the sections outside `skip` are identical, the names of those that differ)."""
    a = [(n, d) for n, d in elf_sections(before) if not any(s in n for s in skip)]
    b = [(n, d) for n, d in elf_sections(after) if not any(s in n for s in skip)]
    if [n for n, _ in a] != [n for n, _ in b]:
        return False, sorted({n for n, _ in a} ^ {n for n, _ in b}) or ["section order"]
    differ = [n for (n, x), (_, y) in zip(a, b) if x != y]
    return not differ, differ


def export_kernels(ref: str, into: Path) -> Path:
    """REF's kernels/ written into `into`."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    names = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{ref}:kernels"], capture_output=True,
                           text=True, check=True).stdout.split()
    into.mkdir(parents=True, exist_ok=True)
    for name in names:
        blob = subprocess.run(["git", "-C", str(root), "show", f"{ref}:kernels/{name}"], capture_output=True,
                              check=True).stdout
        (into / name).write_bytes(blob)
    return into


def unit_command(nvcc: str, arch: str, unit: build.Unit, source_dir: Path, output: Path, kind: str) -> list[str]:
    command = build.compile_command(nvcc, arch, unit, source_dir, output)
    return [kind if part == "-c" else part for part in command]


def compile_all(nvcc: str, plan: list[tuple[str, build.Unit, Path, Path, str]], jobs: int) -> None:
    work = []
    for arch, unit, source_dir, output, kind in plan:
        if output.is_file():
            continue
        output.parent.mkdir(parents=True, exist_ok=True)
        tmp = output.with_suffix(output.suffix + ".tmp")
        work.append(Job(f"{arch} {source_dir.name} {unit.name}", unit_command(nvcc, arch, unit, source_dir, tmp, kind),
                        tmp, output, keep_log=output.with_suffix(".ptxas")))
    run_jobs(work, parallel=jobs, stall_s=build.stall_seconds(),
             on_done=lambda job, s: print(f"  compiled {job.label} in {s:.0f} s", file=sys.stderr, flush=True))


def sass_diff(nvcc: str, arch: str, units: list[build.Unit], sides: dict[str, Path], work: Path, jobs: int) -> str:
    """'' when `cuobjdump -sass` of the two linked libraries is the same, else the diff's first lines."""
    cuobjdump = shutil.which("cuobjdump") or str(Path(nvcc).parent / "cuobjdump")
    plan = [(arch, u, d, work / side / f"{u.name}-{arch}.o", "-c") for side, d in sides.items() for u in units]
    compile_all(nvcc, plan, jobs)
    dumps = []
    for side in sides:
        library = work / side / f"lib-{arch}.so"
        subprocess.run(build.link_command(nvcc, [work / side / f"{u.name}-{arch}.o" for u in units], library), check=True)
        dumps.append(subprocess.run([cuobjdump, "-sass", str(library)], capture_output=True, text=True,
                                    check=True).stdout.splitlines())
    return "\n".join(list(difflib.unified_diff(*dumps, "before", "after", lineterm=""))[:40])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 lab/perf/product_identity.py", description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the git revision to compare the working tree's kernels/ with")
    parser.add_argument("--arch", default="sm_90,sm_120", help="comma-separated archs (default sm_90,sm_120)")
    parser.add_argument("--codebook", default="mcg")
    parser.add_argument("--kernels", default="k3k4", choices=tuple(build.KERNEL_SETS))
    parser.add_argument("--work", type=Path, help="where the sources and cubins go (default: a temporary directory); "
                                                  "cubins already there are reused")
    parser.add_argument("--jobs", type=int, default=1, help="compiles at once (default 1)")
    args = parser.parse_args(argv)
    try:
        nvcc = build.find_nvcc()
        work = args.work or Path(tempfile.mkdtemp(prefix="product-identity-"))
        sides = {"before": export_kernels(args.before, work / "before-src"), "after": build.kernel_source_dir()}
        archs = [build.normalize_arch(a) for a in args.arch.split(",")]
        units = {arch: build.library_units(arch, args.codebook, kernels=args.kernels) for arch in archs}
        plan = [(arch, u, d, work / side / f"{u.name}-{arch}.cubin", "-cubin")
                for arch in archs for u in units[arch] for side, d in sides.items()]
        compile_all(nvcc, plan, args.jobs)
    except (TrellisError, subprocess.CalledProcessError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_GPU
    same_everywhere = True
    print(f"{'arch':7} {'unit':22} {'code':10} {'resources':10} {'whole file':10} debug sections")
    for arch in archs:
        for unit in units[arch]:
            before, after = ((work / side / f"{unit.name}-{arch}.cubin").read_bytes() for side in sides)
            same, differ = compare_elf(before, after)
            lines_same = compare_elf(before, after, skip=())[0]
            same_everywhere &= same
            logs = [work / side / f"{unit.name}-{arch}.ptxas" for side in sides]
            records = [parse_ptxas(log.read_text(errors="replace")) for log in logs if log.is_file()]
            usage = "?" if len(records) < 2 else "identical" if records[0] == records[1] else "DIFFERENT"
            print(f"{arch:7} {unit.name:22} {'identical' if same else 'DIFFERENT':10} {usage:10} "
                  f"{'identical' if before == after else 'differs':10} "
                  f"{'identical' if lines_same else 'differ'}"
                  + (f"  sections: {', '.join(differ)}" if differ else ""))
        if shutil.which("cuobjdump") or (Path(nvcc).parent / "cuobjdump").is_file():
            diff = sass_diff(nvcc, arch, units[arch], sides, work, args.jobs)
            same_everywhere &= not diff
            print(f"{arch:7} cuobjdump -sass of the linked libraries: {'identical' if not diff else 'DIFFERENT'}")
            if diff:
                print(diff)
        else:
            print(f"{arch:7} (no cuobjdump here: the linked libraries' SASS was not diffed)")
    print("product device code identical" if same_everywhere else "product device code DIFFERS")
    return 0 if same_everywhere else EXIT_FINDINGS


if __name__ == "__main__":
    raise SystemExit(main())
