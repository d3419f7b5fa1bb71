"""File-safety rules: what every safetensors checkpoint must satisfy before any tensor is trusted.

Per shard: file size == 8 + header length + data end; every byte range inside the data buffer; no overlaps
and no holes (the safetensors format forbids unindexed bytes); dtype x shape == byte length. Across shards:
no tensor in two files; the index agrees with the headers both ways and its total_size with the data bytes, and
names no path outside the checkpoint directory (the listed files' own names are rules_names', every dialect's).
All of it from headers and the file listing: no tensor data is read.
"""

from __future__ import annotations

from itertools import islice
from operator import attrgetter
from typing import Iterator, Mapping

from trellis_cli.checkpoint.model import Checkpoint
from trellis_cli.checkpoint.reader import index_file_faults
from trellis_cli.checkpoint.tensor_map import files_named
from trellis_cli.findings import MAX_MISSING_SHOWN, Finding, Location, error, error_summary, warning
from trellis_cli.formats.safetensors_layout import Layout, check_shard, shard_layout

_FILE_OF, _BEGIN, _END = attrgetter("file"), attrgetter("begin"), attrgetter("end")


def check_files(ckpt: Checkpoint) -> Iterator[Finding]:
    if not ckpt.headers and not any(f.code.startswith(("file.", "path.")) for f in ckpt.parse_findings):
        yield error("file.none", Location(), "the checkpoint has no safetensors files")
    layouts = {file: shard_layout(header) for file, header in ckpt.headers.items()}
    for file, header in ckpt.headers.items():
        yield from check_shard(file, header, layouts[file])
    yield from _check_duplicates(ckpt)
    if ckpt.index is not None:
        yield from _check_index(ckpt, ckpt.index, layouts)


def _check_duplicates(ckpt: Checkpoint) -> Iterator[Finding]:
    tensors = ckpt.tensors
    # Every name of every header is in one header only: proven where the names of the headers, in file order, are
    # the model's own names in order (merged so by the opening; its keys are unique), compared in C a header at a
    # time (two lists of every name cost ~15 MB at production size); else by a lookup per name.
    headers = [ckpt.headers[file] for file in sorted(ckpt.headers)]
    if len(tensors) == sum(len(header.tensors) for header in headers):
        names = iter(tensors)
        if all(list(header.tensors) == list(islice(names, len(header.tensors))) for header in headers):
            return
        if all(header.tensors.keys() <= tensors.keys() for header in headers):
            return
    for file, header in ckpt.headers.items():
        for name in header.tensors:
            chosen = tensors[name].file
            if chosen != file:
                yield error("tensor.duplicate", Location(file=file, tensor=name),
                            f"tensor is stored in two shards (also in {chosen})", expected="one shard",
                            found=sorted({file, chosen}))


def _check_index(ckpt: Checkpoint, index: Mapping[str, str], layouts: Mapping[str, Layout]) -> Iterator[Finding]:
    index_file, headers = ckpt.index_file, ckpt.headers
    bad_files: set[str] = set()
    named = files_named(index)  # (~935k values, where they are not the headers' own files: read once)
    for file, fault in index_file_faults(ckpt, named):
        bad_files.add(file)
        yield fault
    # The common case, proven in C: the index maps exactly the headers' tensors, each to the file holding it.
    # (The opening proved it already where `index_agrees`.)
    agrees = ((ckpt.index_agrees and index is ckpt.index)
              or index == dict(zip(ckpt.tensors.keys(), map(_FILE_OF, ckpt.tensors.values())))) and \
        len(ckpt.tensors) == sum(len(header.tensors) for header in headers.values())
    for name, file in () if agrees else index.items():
        if file in bad_files or file not in headers:
            continue
        if name not in headers[file].tensors:
            where = ckpt.tensors.get(name)
            found = f"in {where.file}" if where is not None else "in no shard"
            yield error("index.missing-tensor", Location(file=index_file, tensor=name),
                        f"index maps the tensor to {file}, whose header does not have it", expected=file, found=found)
    for file, header in () if agrees else headers.items():
        # Listed per shard up to the cap, then one total: a shard absent from the index may hold 262k tensors.
        unindexed = [name for name in header.tensors if name not in index]
        for name in unindexed[:MAX_MISSING_SHOWN]:
            yield error("index.unindexed", Location(file=file, tensor=name), "tensor is in a shard but not in "
                        "the index (loaders that trust the index will not see it)")
        if len(unindexed) > MAX_MISSING_SHOWN:
            yield error_summary("index.unindexed", Location(file=file), len(unindexed) - MAX_MISSING_SHOWN,
                                "tensors of this shard are not in the index", expected="0 unindexed",
                                found=f"{len(unindexed)} unindexed")
    total = (ckpt.index_metadata or {}).get("total_size")
    if total is None or any(file not in headers for file in named):
        return  # an unreadable shard is already reported; its bytes cannot be summed
    # A sound shard's tensors tile its data from 0: their bytes are its data end, read without a pass.
    data = sum(layouts[f].data_end if f in layouts and layouts[f].sound
               else sum(map(_END, h.tensors.values())) - sum(map(_BEGIN, h.tensors.values())) for f, h in headers.items())
    if total != data:
        yield warning("index.total-size", Location(file=index_file), "metadata.total_size differs from the sum of "
                      "tensor data bytes", expected=data, found=total)
