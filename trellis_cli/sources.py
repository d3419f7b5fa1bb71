"""Sources: where a checkpoint's bytes come from (a local directory, the Hub, the Hub cache).

Every later stage reads through a Source, never through paths or HTTP of its own:
- `list_files()` names every file with its size (the Hub: from the repo tree, pinned to one commit);
- `read_json(name)` reads a small JSON file (size-limited);
- `read_header(name)` parses a safetensors header without reading tensor data;
- `local_path(name)` gives a local file holding the data (a Hub source downloads it first).
A Hub source resolves its revision to a commit sha once; every read uses that sha.

`open_source(spec)` turns what the user typed (nothing, a path, `org/name[@rev]`, `hf://org/name[@rev]`)
into a Source. huggingface_hub is imported only when a Hub source is opened (see hub_client.py, which owns
the error mapping and the 1.x/2.x differences), so local work never pays for it.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, TypedDict, Union

from trellis_cli.errors import CheckFailed, SourceUnavailable, UsageError
from trellis_cli.header import (
    HeaderError,
    JsonError,
    file_kind,
    header_length,
    load_json,
    open_regular,
    os_reason,
    parse_header,
    read_local_header,
    safe_relative,
)
from trellis_cli.header_records import Header

# config.json of a 256-expert model is a few KB; tier_bitmap.json for 76 layers is about 200 KB.
MAX_JSON_BYTES = 64 * 1024 * 1024


class LocalDescription(TypedDict):
    """`describe()` of a local directory: what reports and manifests record of where the bytes came from."""

    kind: Literal["local"]
    path: str
    revision: None


class HubDescription(TypedDict):
    """`describe()` of a Hub repository, its revision resolved once."""

    kind: Literal["hub"]
    repo_id: str
    requested_revision: str
    revision: str | None
    endpoint: str
    offline: bool
    listing_complete: bool


SourceDescription = Union[LocalDescription, HubDescription]


class Source(Protocol):
    """What every later stage may ask of a checkpoint's files (LocalSource and HubSource both answer all of it)."""

    description: str  # for reports: "local directory X" or "hub org/repo@sha"

    @property
    def revision(self) -> str | None: ...  # resolved commit sha (Hub) or None

    @property
    def root(self) -> Path | None: ...  # the local directory the files are in; None: a remote source

    @property
    def special(self) -> dict[str, str]: ...  # listed names that are no regular file ("a FIFO"), never opened

    @property
    def unlistable(self) -> dict[str, str]: ...  # subdirectories that could not be listed -> the reason

    def list_files(self) -> dict[str, int]: ...

    def prefetch_headers(self, names: list[str]) -> None: ...  # a speed-up before many read_header (or nothing)

    def read_json(self, name: str) -> Any: ...

    def read_header(self, name: str) -> Header: ...

    def local_path(self, name: str, *, progress: Callable[[int], None] | None = None) -> Path: ...

    def cached_path(self, name: str) -> Path | None: ...  # a local file with its bytes, never downloading; or None

    def escapes(self, name: str) -> bool: ...  # True when `name` leads outside the checkpoint (never read then)

    def file_info(self, name: str) -> HubFile | None: ...  # what the host lists of a file (LFS sha256); None: local

    def describe(self) -> SourceDescription: ...  # where the bytes came from, as reports and manifests record it


# What the library's entry points accept as a checkpoint: a Source, or a local directory's path.
SourceArg = Union[Source, str, Path]


@dataclass
class LocalSource:
    """A checkpoint directory on local disk. Symlinks that leave the directory are refused.

    Only regular files (or links to them) are listed: FIFOs, sockets and devices are never opened (a FIFO
    blocks its reader forever) and go to `special` instead; subdirectories that cannot be listed go to
    `unlistable` (the root itself raises SourceUnavailable).
    """

    root: Path
    revision: str | None = None
    description: str = ""
    _files: dict[str, int] | None = field(default=None, repr=False)
    special: dict[str, str] = field(default_factory=dict)  # name -> what it is ("a FIFO"), never opened
    unlistable: dict[str, str] = field(default_factory=dict)  # subdirectory -> the OS's reason

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if not self.root.exists():
            raise SourceUnavailable(f"{self.root}: no such directory")
        if not self.root.is_dir():
            raise SourceUnavailable(f"{self.root}: not a directory (a checkpoint is a directory of files)")
        self.description = self.description or f"local directory {self.root}"
        self._real_root = self.root.resolve()

    def list_files(self) -> dict[str, int]:
        if self._files is None:
            files: dict[str, int] = {}
            for dirpath, dirnames, filenames in os.walk(self.root, onerror=self._unlistable):
                # Hidden folders (.cache/huggingface from local_dir downloads, .git) are not checkpoint content.
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                for name in filenames:
                    path = Path(dirpath) / name
                    rel = path.relative_to(self.root).as_posix()
                    try:
                        st = path.stat()
                    except (OSError, RuntimeError):
                        files[rel] = -1  # dangling link or link loop: reported by validate
                        continue
                    if stat.S_ISREG(st.st_mode):
                        files[rel] = st.st_size
                    else:
                        self.special[rel] = file_kind(st.st_mode)
            self._files = dict(sorted(files.items()))
        return self._files

    def _unlistable(self, e: OSError) -> None:
        """os.walk's error hook: it would otherwise skip an unreadable directory silently."""
        path = Path(e.filename or self.root)
        if path == self.root:
            raise SourceUnavailable(f"{self.root}: cannot list the directory ({os_reason(e)})") from e
        self.unlistable[path.relative_to(self.root).as_posix()] = os_reason(e)

    def resolve(self, name: str) -> Path:
        """The path of `name`, refusing anything that leaves the checkpoint directory or cannot be resolved."""
        if not safe_relative(name):
            raise CheckFailed(f"{name}: path leaves the checkpoint directory")
        path = self.root / name
        real = self._real(name)
        if real is None:
            raise CheckFailed(f"{name}: cannot be resolved (symlink loop)")
        if not real.is_relative_to(self._real_root):
            raise CheckFailed(f"{name}: resolves to {real}, outside the checkpoint directory")
        return path

    def escapes(self, name: str) -> bool:
        """True when `name` leaves the directory. A symlink loop does not: it is listed as dangling (size -1)."""
        if not safe_relative(name):
            return True
        real = self._real(name)
        return real is not None and not real.is_relative_to(self._real_root)

    def _real(self, name: str) -> Path | None:
        try:
            return (self.root / name).resolve()
        except (OSError, RuntimeError):  # a symlink loop: RuntimeError before Python 3.13, OSError since
            return None

    def read_json(self, name: str) -> Any:
        return read_json_file(self.resolve(name), name)

    def read_header(self, name: str) -> Header:
        try:
            return read_local_header(self.resolve(name), name)
        except HeaderError as e:
            raise CheckFailed(str(e), code=e.code) from e
        except OSError as e:
            raise CheckFailed(f"{name}: cannot read the file ({os_reason(e)})", code="file.unreadable") from e

    def local_path(self, name: str, *, progress: Callable[[int], None] | None = None) -> Path:
        # Already local: nothing to fetch, so `progress` is never called.
        return self.resolve(name)

    def cached_path(self, name: str) -> Path | None:
        """The file itself (its bytes are local already); None when `name` leaves the directory."""
        return None if self.escapes(name) else self.root / name

    def file_info(self, name: str) -> HubFile | None:
        """None: a local file has no host listing (its identity is the file itself)."""
        return None

    def prefetch_headers(self, names: list[str]) -> None:
        """Nothing to do locally: reading a header is one short read."""

    def describe(self) -> LocalDescription:
        return {"kind": "local", "path": str(self.root), "revision": None}


def read_json_file(path: Path, name: str) -> Any:
    """A JSON file of at most MAX_JSON_BYTES; CheckFailed naming `name` and the reason when it cannot be used."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise CheckFailed(f"{name}: {size} bytes, larger than the {MAX_JSON_BYTES}-byte limit for JSON "
                                  "files", code="json.too-large")
            return load_json(f.read(MAX_JSON_BYTES + 1))
    except FileNotFoundError as e:
        raise SourceUnavailable(f"{name}: not found in {path.parent}") from e
    except OSError as e:
        raise CheckFailed(f"{name}: cannot read the file ({os_reason(e)})", code="json.unreadable") from e
    except JsonError as e:
        raise CheckFailed(f"{name}: {e}", code="json.unreadable") from e


# ---- the Hub -------------------------------------------------------------------------------------------

ProgressCallback = Callable[[int], None]  # called with the number of bytes just processed


@dataclass(frozen=True)
class HeaderWindow:
    """How many bytes the one ranged GET of a remote header asks for, from offset 0 and never past the file's
    end: `first` until a header of this source has been read, then 1.25 x the longest header read so far +
    `margin`, at most `most`. A header longer than its window costs a second GET of exactly its remaining bytes
    (the first file of a production checkpoint: its layer shards' headers are about 1.8 MB; their siblings then
    take one GET each). So a header read transfers at most its window: beyond the header, under
    max(64 KiB, 1.25 x the longest header + 16 KiB) and never more than 16 MiB or past the file's end."""

    first: int = 64 << 10
    margin: int = 16 << 10
    most: int = 16 << 20


HEADER_WINDOW = HeaderWindow()


@dataclass(frozen=True)
class HubFile:
    """What the Hub says about one file at the pinned commit."""

    size: int
    blob_id: str | None = None  # git sha1 of the blob
    lfs_sha256: str | None = None  # sha256 of the content, for LFS files


class HubSource:
    """A model repo on the Hub (or a Hub-compatible endpoint), pinned to one commit.

    The requested revision (branch, tag or sha) is resolved once, here, to a commit sha; every later call
    passes that sha, so a branch moving mid-run cannot mix two commits. Files land in the shared Hub cache.
    Offline (`offline=True` or HF_HUB_OFFLINE=1), everything comes from that cache: refs -> sha -> snapshot.
    """

    def __init__(self, repo_id: str, *, revision: str | None = None, token: str | bool | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, endpoint: str | None = None,
                 offline: bool | None = None) -> None:
        from trellis_cli import hub_client

        self._hub = hub_client
        hub_client.install_timeouts()  # a stalled server must not hang the command
        hub_client.quiet_library_logs()
        self.repo_id = repo_id
        self.root: Path | None = None  # remote: reads go through the Hub cache (local_path, cached_path)
        self.special: dict[str, str] = {}  # the Hub lists regular files only
        self.unlistable: dict[str, str] = {}
        self.requested_revision = revision
        self.token = token  # None: the library's default (HF_TOKEN, then the `hf auth login` token file)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir is not None else None
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.offline = hub_client.is_offline(offline)
        self._repo_folder: Path | None = None
        self._headers: dict[str, Header | Exception] = {}
        self._largest_header: int | None = None  # the longest header length read so far (sizes the next window)
        # Offline, the listing is what the cache holds: shards never downloaded are absent from it.
        self.listing_complete = not self.offline
        if self.offline:
            self.revision, self._files = self._resolve_from_cache()
        else:
            self.revision, self._files = self._resolve_online()
        self.description = f"hub {repo_id}@{self.revision}"

    # -- resolution --------------------------------------------------------------------------------------

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token)

    def _errors(self, file: str | None = None, revision: str | None = None) -> Any:
        return self._hub.hub_errors(self.repo_id, revision or self.revision_label, self.endpoint, file=file)

    @property
    def revision_label(self) -> str:
        return getattr(self, "revision", None) or self.requested_revision or "main"

    def _resolve_online(self) -> tuple[str, dict[str, HubFile]]:
        api = self._api()
        with self._errors(revision=self.requested_revision or "main"):
            resolve = getattr(api, "resolve_revision", None)
            if resolve is not None:
                # Also records refs/<branch> -> sha in the cache, so a later offline run can find the commit.
                sha = resolve(self.repo_id, revision=self.requested_revision, cache_dir=self.cache_dir).resolved
                info = api.model_info(self.repo_id, revision=sha, files_metadata=True)
            else:  # pragma: no cover - libraries before resolve_revision
                info = api.model_info(self.repo_id, revision=self.requested_revision, files_metadata=True)
                sha = info.sha
        if not sha or not self._hub.COMMIT_SHA.fullmatch(sha):
            raise SourceUnavailable(f"{self.repo_id}: the Hub returned no commit sha for {self.revision_label!r}")
        files = {}
        for sibling in info.siblings or []:
            lfs = sibling.lfs
            files[sibling.rfilename] = HubFile(
                size=sibling.size if sibling.size is not None else -1,
                blob_id=sibling.blob_id,
                lfs_sha256=(lfs.sha256 if hasattr(lfs, "sha256") else lfs.get("sha256")) if lfs else None,
            )
        return sha, dict(sorted(files.items()))

    def _resolve_from_cache(self) -> tuple[str, dict[str, HubFile]]:
        sha = self._hub.resolve_cached_revision(self.repo_id, self.requested_revision, self.cache_dir)
        if sha is None:
            raise SourceUnavailable(
                f"{self._hub.describe_target(self.repo_id, self.requested_revision or 'main')}: not in the local "
                f"Hub cache ({self._hub.cache_root(self.cache_dir)}) and {self._hub.OFFLINE_HINT}"
            )
        snapshot = self._hub.repo_cache_folder(self.repo_id, self.cache_dir) / "snapshots" / sha
        files = {}
        for path in sorted(p for p in snapshot.rglob("*") if p.is_file()):
            # The cache names blobs by their ETag: sha256 for LFS files, the git blob sha1 for the others.
            blob = path.resolve().name
            files[path.relative_to(snapshot).as_posix()] = HubFile(
                size=path.stat().st_size,
                blob_id=blob if re.fullmatch(r"[0-9a-f]{40}", blob) else None,
                lfs_sha256=blob if re.fullmatch(r"[0-9a-f]{64}", blob) else None,
            )
        return sha, files

    # -- the Source protocol ----------------------------------------------------------------------------

    def list_files(self) -> dict[str, int]:
        return {name: f.size for name, f in self._files.items()}

    def file_info(self, name: str) -> HubFile:
        if not safe_relative(name):
            raise CheckFailed(f"{name}: path leaves the checkpoint directory")
        if name not in self._files:
            if self.offline:  # offline, the listing holds only what the cache has
                raise SourceUnavailable(f"{name} in {self.repo_id}@{self.revision}: not in the local Hub cache "
                                        f"and {self._hub.OFFLINE_HINT}")
            raise SourceUnavailable(f"{name}: no such file in {self.repo_id}@{self.revision}")
        return self._files[name]

    def cached_path(self, name: str) -> Path | None:
        """The file in the local Hub cache at the pinned commit, or None (never touches the network)."""
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(self.repo_id, name, cache_dir=self.cache_dir, revision=self.revision)
        return Path(found) if isinstance(found, str) else None

    def escapes(self, name: str) -> bool:
        """True when `name` leaves the repository: `..` or an absolute path, or a cached snapshot file that is a
        link resolving outside this repository's folder of the Hub cache (its blobs live there; a link to a copy
        elsewhere is never read, and offline its target's name would stand in for the Hub's hash)."""
        if not safe_relative(name):
            return True
        cached = self.cached_path(name)
        return cached is not None and self._outside_cache(cached)

    def _outside_cache(self, path: Path) -> bool:
        try:
            real = path.resolve()
        except (OSError, RuntimeError):  # a link loop: dangling, not an escape
            return False
        if self._repo_folder is None:
            self._repo_folder = self._hub.repo_cache_folder(self.repo_id, self.cache_dir).resolve()
        return not real.is_relative_to(self._repo_folder)

    def _refuse_escape(self, name: str, path: Path) -> Path:
        if self._outside_cache(path):
            raise CheckFailed(f"{name}: the cached file resolves to {path.resolve()}, outside the Hub cache folder "
                              f"of {self.repo_id}; not read", code="path.escape")
        return path

    def local_path(self, name: str, *, progress: ProgressCallback | None = None) -> Path:
        """Download `name` at the pinned commit into the Hub cache (no-op when cached); its local path."""
        from huggingface_hub import hf_hub_download

        self.file_info(name)
        bar = self._hub.CallbackBar.bound_to(progress) if progress else self._hub.CallbackBar
        with self._errors(file=name):
            path = hf_hub_download(
                self.repo_id, name, revision=self.revision, cache_dir=self.cache_dir, endpoint=self.endpoint,
                token=self.token, local_files_only=self.offline, tqdm_class=bar,
            )
        return self._refuse_escape(name, Path(path))

    def read_json(self, name: str) -> Any:
        size = self.file_info(name).size
        if size > MAX_JSON_BYTES:
            raise CheckFailed(f"{name}: {size} bytes, larger than the {MAX_JSON_BYTES}-byte limit for JSON files",
                              code="json.too-large")
        return read_json_file(self.local_path(name), name)

    def prefetch_headers(self, names: list[str], workers: int = 8) -> None:
        """Read many headers concurrently, one ranged GET per file in the common case (see HEADER_WINDOW);
        read_header then answers from memory. Until a header size is known, the first file is read alone so
        that its siblings' windows are sized from it."""
        from concurrent.futures import ThreadPoolExecutor

        def fetch(name: str) -> None:
            try:
                self._headers[name] = self._read_header_now(name)
            except (CheckFailed, SourceUnavailable) as e:
                self._headers[name] = e

        todo = [n for n in names if n not in self._headers]
        if todo and self._largest_header is None:
            fetch(todo.pop(0))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(fetch, todo))

    def read_header(self, name: str) -> Header:
        """Parse a safetensors header: from the cache when the file is there, else one ranged read (two when
        the header is longer than the window asked for)."""
        found = self._headers.pop(name, None)
        if isinstance(found, Exception):
            raise found
        return found if found is not None else self._read_header_now(name)

    def _read_header_now(self, name: str) -> Header:
        size = self.file_info(name).size
        cached = self.cached_path(name)
        try:
            if cached is not None:  # a cached file's header sizes the windows of its siblings too
                header = read_local_header(self._refuse_escape(name, cached), name)
                self._largest_header = max(self._largest_header or 0, header.header_len)
                return header
            if self.offline:
                raise SourceUnavailable(
                    f"{name} in {self.repo_id}@{self.revision}: not in the local Hub cache and {self._hub.OFFLINE_HINT}"
                )
            return self._read_remote_header(name, size if size >= 0 else None)
        except HeaderError as e:
            raise CheckFailed(str(e), code=e.code) from e
        except OSError as e:  # the cached copy cannot be read
            raise CheckFailed(f"{name}: cannot read the file ({os_reason(e)})", code="file.unreadable") from e

    def header_window(self, size: int | None) -> int:
        """The bytes the first ranged read of a header asks for (HEADER_WINDOW), never past the file's end."""
        if self._largest_header is None:
            window = HEADER_WINDOW.first
        else:
            window = min(HEADER_WINDOW.most, self._largest_header * 5 // 4 + HEADER_WINDOW.margin)
        return max(8, min(window, size)) if size is not None else window

    def _read_remote_header(self, name: str, size: int | None) -> Header:
        window = self.header_window(size)
        with self._errors(file=name):
            data = self._read_range(name, 0, window) if size != 0 else b""  # an empty file: nothing to ask for
            expected = window if size is None else min(window, size)
            if len(data) < expected and (size is not None or len(data) < 8):
                raise SourceUnavailable(f"{name}: the server sent {len(data)} of the {expected} bytes asked for")
            n = header_length(data[:8], name, size)
            self._largest_header = max(self._largest_header or 0, n)
            if 8 + n > len(data):  # the header is longer than the window: its rest, exactly
                rest = self._read_range(name, len(data), 8 + n - len(data))
                if len(rest) != 8 + n - len(data):
                    raise SourceUnavailable(f"{name}: the server sent {len(rest)} of the "
                                            f"{8 + n - len(data)} header bytes asked for")
                data += rest
        return parse_header(name, data[8:8 + n], n, size)

    def _read_range(self, name: str, start: int, length: int) -> bytes:
        return self._hub.read_range(self.repo_id, name, self.revision, self.endpoint, self.token, start, length)

    def describe(self) -> HubDescription:
        return {
            "kind": "hub",
            "repo_id": self.repo_id,
            "requested_revision": self.requested_revision or "main",
            "revision": self.revision,
            "endpoint": self.endpoint or self._hub.default_endpoint(),
            "offline": self.offline,
            "listing_complete": self.listing_complete,
        }


# ---- opening a source from what the user typed ----------------------------------------------------------

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def parse_repo_spec(spec: str) -> tuple[str, str | None] | None:
    """`org/name`, `org/name@rev`, `hf://org/name@rev` (also `hf://models/...`) -> (repo_id, rev); else None."""
    text = spec[len("hf://"):] if spec.startswith("hf://") else spec
    if text.startswith("models/") and text.count("/") == 2:
        text = text[len("models/"):]
    repo_id, _, revision = text.partition("@")
    if not _REPO_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id or repo_id.endswith((".", "-")):
        return None
    if "@" in text and not revision:
        return None
    return repo_id, revision or None


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~", ".\\")) or spec.count("/") > 1 or "\\" in spec


def open_source(spec: str | None, *, revision: str | None = None, token: str | bool | None = None,
                cache_dir: str | os.PathLike[str] | None = None, endpoint: str | None = None,
                offline: bool | None = None) -> Source:
    """The Source for `spec`: None -> the bundled sample, an existing path -> local, `org/name[@rev]` -> Hub.

    An existing local path wins over a repo id of the same spelling; `hf://org/name` always means the Hub.
    """
    if spec is not None and not spec.strip():
        raise UsageError("SOURCE is empty: give a directory or a Hub repo id, or omit it for the bundled sample")
    if spec is None:
        _no_revision_for_local(revision, "the bundled sample")
        return LocalSource(_sample_path(), description="bundled sample checkpoint")
    if not spec.startswith("hf://") and Path(spec).expanduser().exists():
        _no_revision_for_local(revision, spec)
        return LocalSource(Path(spec).expanduser())
    parsed = None if (_looks_like_path(spec) and not spec.startswith("hf://")) else parse_repo_spec(spec)
    if parsed is None:
        if _looks_like_path(spec):
            raise SourceUnavailable(f"{spec}: no such file or directory")
        raise SourceUnavailable(f"{spec}: not an existing path and not a Hub repo id (expected org/name[@revision])")
    repo_id, spec_revision = parsed
    if spec_revision and revision and spec_revision != revision:
        raise UsageError(f"{spec}: revision {spec_revision!r} in the id conflicts with --revision {revision!r}")
    if spec.startswith("hf://"):
        return HubSource(repo_id, revision=spec_revision or revision, token=token, cache_dir=cache_dir,
                         endpoint=endpoint, offline=offline)
    try:
        return HubSource(repo_id, revision=spec_revision or revision, token=token, cache_dir=cache_dir,
                         endpoint=endpoint, offline=offline)
    except SourceUnavailable as e:
        # `work/glmm` reads as a repo id too: a mistyped relative path must not look like a Hub problem only.
        raise SourceUnavailable(
            f"{spec}: neither a local directory (no such path under {Path.cwd()}) nor a reachable Hub repo ({e}); "
            f"for a directory, check the spelling or write it as ./{spec}; for the Hub, write hf://{spec}") from e


def _no_revision_for_local(revision: str | None, what: str) -> None:
    if revision:
        raise UsageError(f"--revision applies to Hub repos only, not to {what}")


def _sample_path() -> Path:
    try:
        from trellis_cli.sample import sample_path
    except ImportError as e:
        raise SourceUnavailable("no SOURCE given and the bundled sample checkpoint is not installed") from e
    return Path(sample_path("tr3"))
