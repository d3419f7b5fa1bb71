"""A bounded, fail-closed parser for safetensors headers.

Used for local files and for header bytes fetched from the Hub alike, so both get the same checks.
The rules follow the safetensors format: u64 little-endian header length N, N bytes of UTF-8 JSON object,
then the data buffer; `data_offsets` are [begin, end) relative to the buffer start.
Structural problems that make the header unusable raise HeaderError; problems between entries
(overlaps, holes, size mismatches) are left to validate, which reports them as findings.
Also the two guards every local read of checkpoint bytes shares: `load_json` (depth and Unicode checks for any
JSON file) and `open_regular` (never blocks on a FIFO or reads a device).
A header in safetensors' own layout is read in bulk first (`header_layout.py`); the records both build are in
`header_records.py`.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import struct
from pathlib import PurePosixPath
from typing import Any, TypeGuard

from trellis_cli.header_layout import parse_canonical
from trellis_cli.header_records import DTYPE_NAMES, DTYPE_BYTES, MAX_HEADER_TENSORS, Entries, Header, TensorEntry

# The Hub's own parser refuses headers above 25 MB; the safetensors reader above 100 MB. A production
# MoE layer shard (12,288 tensors) has a header of about 1.5 MB.
MAX_HEADER_BYTES = 100_000_000
# safetensors reads dims, offsets and byte counts as u64 (the bit count of a tensor, too); torch indexes a
# dimension with an int64. Larger numbers are refused by one or the other even when the product is zero.
U64_MAX = (1 << 64) - 1
MAX_DIM = (1 << 63) - 1


class HeaderError(ValueError):
    """The header cannot be parsed; the message says what was expected and what was found. `code` names the
    finding validate reports for it."""

    def __init__(self, message: str, code: str = "file.header") -> None:
        super().__init__(message)
        self.code = code


class JsonError(ValueError):
    """Bytes that load_json refuses; the message says why (no file name: callers add it)."""


class NotRegularFile(OSError):
    """A FIFO, socket or device where a file was expected: never read (a FIFO would block forever)."""


# A lone surrogate can only come from a \uD800-\uDFFF escape (UTF-8 cannot encode one): search for the escape
# before walking the document, so ordinary files pay one regex scan.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def load_json(data: bytes | str, *, strict_numbers: bool = False) -> Any:
    """json.loads for checkpoint files: JsonError for bytes that are not UTF-8, not JSON, nested too deeply
    for the parser, an object holding a key twice (Python keeps the last silently; which one a reader
    sees is not defined), or strings that are not valid Unicode (a lone surrogate escape; safetensors
    refuses them). `strict_numbers` also refuses what a strict JSON parser (safetensors') refuses and Python
    accepts: NaN and Infinity, floats out of range, and `-0` (read as a float, not the integer 0)."""
    if not strict_numbers:
        fast = _plain_json(data)
        if fast is not None:
            return fast[0]
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        hooks = _strict_hooks(text) if strict_numbers else {}
        value = json.loads(text, object_pairs_hook=_reject_duplicate_keys, **hooks)
    except UnicodeDecodeError as e:
        raise JsonError(f"not UTF-8 ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise JsonError(f"not valid JSON ({e.msg} at byte {e.pos})") from e
    except RecursionError as e:
        raise JsonError("invalid JSON (nested too deeply)") from e
    except JsonError:  # the hooks' own refusals (a ValueError too)
        raise
    except ValueError as e:  # Python's int() refuses numbers of more than 4300 digits (sys.get_int_max_str_digits)
        raise JsonError("not usable (a number with more digits than Python converts)") from e
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = text_escape(e.object[e.start:e.end])
            raise JsonError(f"not valid Unicode (a string holds the lone surrogate {bad})") from e
    return value


# In JSON text without a backslash every `"` delimits a string, so this scan, from the first `"` on, visits every
# string once and marks the keys (a string followed by `:`).
_STRING_OR_KEY = re.compile(r'"[^"]*"[ \t\n\r]*(:?)')


def _plain_json(data: bytes | str) -> tuple[Any] | None:
    """(value,) of a document `load_json` accepts as plain `json.loads` reads it, proven without a hook per object
    (a production index has ~935k keys): no backslash (so no escape, no lone surrogate), and as many keys in the
    value as in the text (so none twice in one object). None for anything else: the checked path decides and
    words every refusal."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        if "\\" in text:
            return None
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if _key_count(value) != _text_keys(text):
        return None
    return (value,)


def _text_keys(text: str) -> int:
    """At least as many as the keys written in a JSON text without a backslash, and exactly as many where no key
    is followed by whitespace before its colon nor any string begins with a colon: each `":` then ends a key.
    Where whitespace may stand before a colon, the keys counted string by string."""
    if any(space in text for space in " \t\n\r") and _SPACED_COLON.search(text) is not None:
        return _STRING_OR_KEY.findall(text).count(":")
    return text.count('":')


_SPACED_COLON = re.compile(r'"[ \t\n\r]+:')


def _key_count(value: Any) -> int:
    """The keys of every object in a decoded JSON value (no recursion: the depth is the document's)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if type(item) is dict:
            count += len(item)
            stack.extend(v for v in item.values() if type(v) is dict or type(v) is list)
        elif type(item) is list:
            stack.extend(v for v in item if type(v) is dict or type(v) is list)
    return count


def _added(seen: set[str], key: str) -> bool:
    """Add `key` to `seen`; False, so that a generator's condition goes on to the next key."""
    seen.add(key)
    return False


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):  # the cheap test first: a production header has ~12k entries per shard
        seen: set[str] = set()
        duplicate = next(key for key, _ in pairs if key in seen or _added(seen, key))
        raise JsonError(f"not usable (the key {text_escape(repr(duplicate))[:80]} appears twice in one object)")
    return out


def _refuse_constant(name: str) -> None:
    raise JsonError(f"not valid JSON ({name} is not a JSON number)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"not valid JSON (the number {text[:40]} is out of range)")
    return value


def _int_or_negative_zero(text: str) -> int | float:
    return -0.0 if text == "-0" else int(text)  # a strict parser reads -0 as a float, never as a usize


def _strict_hooks(text: str) -> dict:
    hooks = {"parse_constant": _refuse_constant, "parse_float": _finite_float}
    if "-0" in text:  # a hook on every integer costs a third of a header's parse: only when one may be -0
        hooks["parse_int"] = _int_or_negative_zero
    return hooks


def text_escape(text: str) -> str:
    """`text` with non-ASCII characters escaped (`\\ud800`): safe to show whatever it holds."""
    return text.encode("ascii", "backslashreplace").decode("ascii")


def safe_relative(name: str) -> bool:
    """True when `name` stays inside the checkpoint: relative, no `..`, no backslashes, drive letters or NUL."""
    if not name or "\\" in name or "\0" in name or name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        return False
    return ".." not in PurePosixPath(name).parts


def plain_relative(name: object) -> bool:
    """A name trellis may write under an output directory: `safe_relative`, and every `/`-separated part a plain
    name (none empty, `.` or `..`), no control character."""
    return (isinstance(name, str) and safe_relative(name) and not any(ord(c) < 32 or ord(c) == 127 for c in name)
            and all(part not in ("", ".", "..") for part in name.split("/")))


def open_regular(path: str | os.PathLike) -> io.BufferedReader:
    """Open a file for reading, refusing FIFOs, sockets and devices without blocking on them.

    O_NONBLOCK makes opening a FIFO return at once (it changes nothing for regular files); fstat then
    checks what was really opened, so a file swapped after the directory was listed is refused too.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(f"{file_kind(mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "a special file"


def os_reason(e: OSError) -> str:
    """The OS's words for an error (`Permission denied`), without the path it may carry."""
    return e.strerror or str(e)


def header_length(prefix: bytes, file: str, file_size: int | None) -> int:
    """Decode N from the first 8 bytes and check its bounds."""
    if len(prefix) < 8:
        raise HeaderError(f"{file}: file is {len(prefix)} bytes, shorter than the 8-byte header length",
                          "file.truncated")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n == 0 or n > MAX_HEADER_BYTES:
        raise HeaderError(f"{file}: header length {n} is outside 1..{MAX_HEADER_BYTES}", "file.header-length")
    if file_size is not None and 8 + n > file_size:
        raise HeaderError(f"{file}: header length {n} runs past the end of the {file_size}-byte file",
                          "file.header-length")
    return n


def parse_header(file: str, header_bytes: bytes, header_len: int, file_size: int | None) -> Header:
    """Parse the JSON header (the N bytes after the length prefix), refusing what safetensors refuses."""
    if len(header_bytes) != header_len:
        raise HeaderError(f"{file}: header truncated: expected {header_len} bytes, read {len(header_bytes)}")
    fast = parse_canonical(file, header_bytes, header_len, file_size)
    if fast is not None:
        return fast
    fields = header_bytes.count(b'"data_offsets"')  # one per entry: refuse a huge header before parsing it
    if fields > MAX_HEADER_TENSORS:
        raise HeaderError(f"{file}: header has {fields} data_offsets fields, more tensors than the limit of "
                          f"{MAX_HEADER_TENSORS} per file", "file.too-many-tensors")
    try:
        raw = load_json(header_bytes, strict_numbers=True)
    except JsonError as e:
        raise HeaderError(f"{file}: header is {e}") from e
    if not isinstance(raw, dict):
        raise HeaderError(f"{file}: header is a JSON {type(raw).__name__}, expected an object")
    metadata = raw.pop("__metadata__", None)
    if metadata is None:  # absent or null; `false`, 0, "" and [] are refused by safetensors, so here too
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        found = type(metadata).__name__ if not isinstance(metadata, dict) else "a value that is not a string"
        raise HeaderError(f"{file}: __metadata__ must map strings to strings (safetensors refuses the file), "
                          f"found {found}")
    if len(raw) > MAX_HEADER_TENSORS:
        raise HeaderError(f"{file}: header lists {len(raw)} tensors, more than the limit of {MAX_HEADER_TENSORS} "
                          "per file", "file.too-many-tensors")
    tensors = [_parse_entry(file, name, info, 8 + header_len) for name, info in raw.items()]
    return Header(file=file, header_len=header_len, file_size=file_size, tensors=Entries(tensors), metadata=metadata)


def is_int(value: object) -> TypeGuard[int]:
    """A JSON integer: True for 3, False for 3.0 and for `true` (bool is an int subclass in Python)."""
    return type(value) is int


def coerced_int(value: object) -> int | None:
    """What Python's int() makes of a JSON integer, an integral number or a string (as the #190-era loaders
    read counts and bitrates: "4" and 4.0 pass), or None where int() would raise or round (3.5, "3.0", true)."""
    if type(value) is int:
        return value
    if type(value) is float:
        return int(value) if value.is_integer() else None
    if type(value) is str and len(value) <= 32:
        try:
            return int(value)
        except ValueError:
            return None
    return None


def _parse_entry(file: str, name: str, info: object, data_start: int) -> TensorEntry:
    if type(info) is not dict:
        raise HeaderError(f"{file}: {name}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(dtype) is not str or dtype not in DTYPE_BYTES:
        raise HeaderError(f"{file}: {name}: unknown dtype {_short(dtype)}")
    if type(shape) is not list:
        raise HeaderError(f"{file}: {name}: shape must be a list of integers in 0..{MAX_DIM}, found {_short(shape)}")
    product = 1
    for d in shape:  # one pass: the types, the bounds, and the size as safetensors computes it
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            raise HeaderError(f"{file}: {name}: shape must be a list of integers in 0..{MAX_DIM}, found "
                              f"{_short(shape)}")
        product *= d
        if product > U64_MAX:
            break
    if product * DTYPE_BYTES[dtype] * 8 > U64_MAX:
        # safetensors multiplies the dims left to right, then by the dtype's bits, refusing any step above
        # u64: [2^32, 2^32, 0] is refused although it holds no element, [0, 2^32, 2^32] is not.
        raise HeaderError(f"{file}: {name}: shape {_short(shape)} overflows a 64-bit size as safetensors computes "
                          "it (dimension by dimension, then x the dtype's bits), even with a zero dimension")
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int
            or not 0 <= offsets[0] <= offsets[1] <= U64_MAX):
        raise HeaderError(f"{file}: {name}: data_offsets must be [begin, end] with 0 <= begin <= end < 2^64, "
                          f"found {_short(offsets)}")
    return TensorEntry(name, file, DTYPE_NAMES[dtype], tuple(shape), offsets[0], offsets[1], data_start)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def read_local_header(path, rel_name: str) -> Header:
    """Read and parse the header of a local file, reading only the header bytes. OSError when it cannot be
    read (NotRegularFile for a FIFO or device)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), rel_name, size)
        return parse_header(rel_name, f.read(n), n, size)
