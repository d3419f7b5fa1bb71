"""One module reads a checkpoint's headers and listing: `trellis_cli/checkpoint/reader.py` (on the primitives of
`header.py` and `sources.py`). Every other module asks it, so every command gets the same guards (a FIFO, a
link loop, a name leaving the directory, a file changed since it was listed, the bounded parser).

Read from the source (AST): a call of a header reader or of a source's listing anywhere else fails, except in
the modules listed below, each for its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "trellis_cli"

HEADER_READS = {"read_header", "read_local_header", "parse_header", "header_length", "prefetch_headers",
                "read_local_header_bytes"}
LISTINGS = {"list_files"}
OPENS = {"open_regular"}

THE_READER = "checkpoint/reader.py"
PRIMITIVES = {"header.py", "sources.py"}  # what the reader stands on: the parser and the sources themselves
# Modules that read bytes trellis itself has just written (its staged output, read back to verify it), or
# that are below the reader's layer (sources): never a checkpoint's header read for an answer.
READ_BACK = {
    "dialects/tr3/shard.py": HEADER_READS,  # a written TR3 shard, read back
    "dialects/tr3/write.py": HEADER_READS,  # the staged TR3 output's own index
    "dialects/carry.py": HEADER_READS,  # a written extra/ file, read back
    # Renaming and joining conversions: a written file read back, and a source layer file's header read again
    # while it is copied (the source was opened through the reader and validated before the conversion starts).
    "dialects/btx/write.py": HEADER_READS,
    "dialects/glm53/write.py": HEADER_READS,
    "dialects/exl3v1/from_tr3.py": HEADER_READS,  # a written exl3-v1 layer file, read back
    "dialects/routepack/readback.py": HEADER_READS,  # a written layer file, streamed back
    "dialects/routepack/verify.py": HEADER_READS,  # a route pack against its manifest (its own bounded reads)
    "integrity.py": LISTINGS | OPENS,  # sha256 of whole files (sources layer, below the reader)
    "selection.py": LISTINGS,  # which files to download (sources layer, below the reader)
    "validate/checksums.py": LISTINGS,  # whether a local MANIFEST.sha256 is there
    "dialects/routepack/manifest.py": OPENS,  # sha256 of a file
    "diff/hashing.py": OPENS,  # sha256 of a unit's bytes (tensor data, not a header)
}


def _calls(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in HEADER_READS | LISTINGS | OPENS:
                found.append((name, node.lineno))
    return found


def test_only_the_reader_reads_headers_and_listings():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == THE_READER or rel in PRIMITIVES:
            continue
        allowed = READ_BACK.get(rel, set())
        offenders += [f"{rel}:{line}: {name}()" for name, line in _calls(path) if name not in allowed]
    assert not offenders, "read checkpoint bytes through trellis_cli/checkpoint/reader.py:\n" + "\n".join(offenders)


def test_the_commands_named_by_the_issue_use_the_reader():
    """fit, diff's units (the dialects answer for their bytes: the shards' and a container's other files in
    dialects/units.py, a route pack's layer files in dialects/routepack/units.py), the quick plan, inspect
    --tensors and the opening import the reader."""
    for rel in ("fit/run.py", "dialects/units.py", "dialects/routepack/units.py", "diff/run.py",
                "dialects/routepack/preflight.py", "inspect_tensors.py", "inspect_request.py", "dialects/open.py"):
        source = (PACKAGE / rel).read_text()
        assert "checkpoint.reader" in source or "checkpoint import reader" in source, rel


def test_the_guard_sees_a_header_read(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def f(source):\n    return source.read_header('x.safetensors')\n")
    assert _calls(sample) == [("read_header", 2)]
