"""A loopback Hub: enough of the Hub's HTTP protocol for the real huggingface_hub client (1.x and 2.x).

Serves local directories as model repos on 127.0.0.1 (random port), with branches and tags pointing to
fake commit shas. Routes (repo ids are `org/name`; revisions are URL-quoted, so `refs/pr/1` is one segment):

- GET  /api/models/{repo}[/revision/{rev}]     model info; `?blobs=true` adds size, blobId and lfs per sibling
- GET  /api/models/{repo}/tree/{rev}[/{path}]  tree listing (`?recursive=true`), lfs {oid, size, pointerSize}
- POST /api/models/{repo}/paths-info/{rev}     info for the form field `paths`
- HEAD/GET /{repo}/resolve/{rev}/{path}        X-Repo-Commit, ETag (git sha1, or sha256 for LFS files);
  LFS files answer 302 to /lfs-blobs/..., which carries ETag, size and honours Range (206)
- errors: 404 with X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound; 401 RepoNotFound for a
  private repo without the server's token; 403 GatedRepo for a gated one. No Xet headers, so the client downloads over plain HTTP.

Files are served from disk: sizes come from stat, range requests read only their bytes. By default
`add_commit` copies the directory into the server's own folder, so later changes to it do not leak into a
served commit; `in_place=True` serves the directory as it is (a sparse checkpoint of hundreds of GB, which the
caller leaves alone). An LFS file's sha256 is computed, by streaming, only when a response needs it, or given
by the caller (`lfs_sha256`) for files no test downloads whole: the client checks it only then. Its git oid is
that of its LFS pointer, as on the Hub, so listings never read a file's data. The server counts every body
byte it sends per file, and separately the bytes that fall in a safetensors file's data buffer (after 8 +
header length): tests assert header-only reads send no tensor data beyond their speculative window
(`tensor_bytes_past_window`).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import struct
import tempfile
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt")
LFS_MIN_SIZE = 10 * 1024 * 1024
CHUNK = 1 << 20


def _lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _git_blob_sha1(path: Path, size: int) -> str:
    digest = hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class ServedFile:
    path: Path  # the file on disk; never rewritten while served
    size: int
    lfs: bool
    data_start: int | None  # safetensors: first byte of the data buffer; None for other files
    known_sha256: str | None = None  # given, or computed on first need
    known_git_sha1: str | None = None
    served_path: Path | None = None  # when set, served instead of `path` (a corrupted blob)
    hashing: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_path(cls, name: str, path: Path, sha256: str | None = None) -> "ServedFile":
        size = path.stat().st_size
        lfs = name.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE
        data_start = None
        if name.endswith(".safetensors") and size >= 8:
            with open(path, "rb") as f:
                data_start = 8 + struct.unpack("<Q", f.read(8))[0]
        return cls(path, size, lfs, data_start, sha256 if lfs else None)

    @property
    def sha256(self) -> str:
        with self.hashing:
            if self.known_sha256 is None:
                digest = hashlib.sha256()
                with open(self.path, "rb") as f:
                    while chunk := f.read(CHUNK):
                        digest.update(chunk)
                self.known_sha256 = digest.hexdigest()
            return self.known_sha256

    @property
    def git_sha1(self) -> str:
        """The git blob id: of the LFS pointer for an LFS file (as on the Hub), else of the content."""
        if self.lfs:
            pointer = _lfs_pointer(self.sha256, self.size)
            return hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
        with self.hashing:
            if self.known_git_sha1 is None:
                self.known_git_sha1 = _git_blob_sha1(self.path, self.size)
            return self.known_git_sha1

    @property
    def pointer_size(self) -> int:
        return len(_lfs_pointer("0" * 64, self.size))

    def chunks(self, begin: int, end: int):
        """The served bytes [begin, end), read from disk in pieces."""
        with open(self.served_path or self.path, "rb") as f:
            f.seek(begin)
            left = end - begin
            while left > 0:
                chunk = f.read(min(CHUNK, left))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk

    def entry(self, path: str) -> dict:
        """A tree / paths-info entry."""
        out = {"type": "file", "oid": self.git_sha1, "size": self.size, "path": path}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return out

    def sibling(self, path: str, with_blobs: bool) -> dict:
        out: dict = {"rfilename": path}
        if with_blobs:
            out.update(size=self.size, blobId=self.git_sha1)
            if self.lfs:
                out["lfs"] = {"sha256": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return out


@dataclass
class Repo:
    repo_id: str
    private: bool = False
    gated: bool = False  # exists publicly, but content needs an approved token
    commits: dict[str, dict[str, ServedFile]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision in self.refs:
            return self.refs[revision]
        return revision if revision in self.commits else None


class HubServer:
    """Start with `with HubServer() as hub:`; `hub.endpoint` is the URL to pass as endpoint / HF_ENDPOINT."""

    def __init__(self, token: str = "hf_loopback_secret") -> None:
        self.token = token
        self.repos: dict[str, Repo] = {}
        self.lock = threading.Lock()
        self.bytes_served: dict[tuple[str, str], int] = defaultdict(int)
        self.tensor_bytes_served: dict[tuple[str, str], int] = defaultdict(int)
        self.data_starts: dict[tuple[str, str], int] = {}  # safetensors files sent: 8 + header length
        self.requests: list[tuple[str, str, str | None, int]] = []  # (method, path, range, status)
        self._counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        # Requests whose path this predicate accepts are read and never answered (a stalled server).
        self.stall: Callable[[str], bool] | None = None
        # False: Range headers are ignored and every file is sent whole with 200 (a server or proxy that does).
        self.honour_ranges = True
        self._stopping = threading.Event()
        self._files = tempfile.TemporaryDirectory(prefix="hub-server-")  # commit copies, corrupted blobs
        self.connections: dict[threading.Thread, socket.socket] = {}  # each open connection's handler thread

    # -- lifecycle ---------------------------------------------------------------------------------------

    def __enter__(self) -> "HubServer":
        handler = type("Handler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopping.set()  # lets stalled handlers return
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        # The client keeps its connections open (a pool), each with a handler thread waiting on it: closed here, so
        # that no thread outlives the server (a command scans its shards in forked workers only where none runs).
        with self.lock:
            handlers = dict(self.connections)
        for connection in handlers.values():
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in handlers:
            thread.join(timeout=5)
        self._files.cleanup()

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None, "server not started"
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    # -- content -----------------------------------------------------------------------------------------

    def add_commit(self, repo_id: str, directory: str | Path, *, branch: str = "main", tags: tuple[str, ...] = (),
                   private: bool | None = None, gated: bool | None = None, in_place: bool = False,
                   lfs_sha256: dict[str, str] | None = None) -> str:
        """Snapshot `directory` as a new commit of `repo_id` (created if new); move `branch` to it.

        `in_place`: serve the files where they are instead of a copy. `lfs_sha256`: the sha256 of LFS files
        by repo path, taken as given (for files too large to hash that no test downloads whole).
        """
        root = Path(directory)
        with self.lock:
            self._counter += 1
            counter = self._counter
        home = root if in_place else Path(self._files.name) / f"commit-{counter}"
        files = {}
        for p in sorted(root.rglob("*")):
            if not p.is_file():
                continue
            name = p.relative_to(root).as_posix()
            served_at = home / name
            if not in_place:
                served_at.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(p, served_at)
            files[name] = ServedFile.from_path(p.name, served_at, (lfs_sha256 or {}).get(name))
        with self.lock:
            repo = self.repos.setdefault(repo_id, Repo(repo_id))
            if private is not None:
                repo.private = private
            if gated is not None:
                repo.gated = gated
            sha = hashlib.sha1(f"{repo_id}:{counter}".encode()).hexdigest()
            repo.commits[sha] = files
            for ref in (branch, *tags):
                repo.refs[ref] = sha
        return sha

    def set_ref(self, repo_id: str, ref: str, sha: str) -> None:
        with self.lock:
            self.repos[repo_id].refs[ref] = sha

    def corrupt(self, repo_id: str, sha: str, name: str) -> None:
        """Serve `name` with one byte flipped while the metadata (size, sha256) still describes the original."""
        served = self.repos[repo_id].commits[sha][name]
        served.sha256  # the listed hash stays the original's
        with self.lock:
            self._counter += 1
            copy = Path(self._files.name) / f"corrupt-{self._counter}"
        shutil.copyfile(served.path, copy)
        with open(copy, "r+b") as f:
            f.seek(served.size // 2)
            byte = f.read(1)[0]
            f.seek(served.size // 2)
            f.write(bytes([byte ^ 0xFF]))
        served.served_path = copy

    def reset_counters(self) -> None:
        with self.lock:
            self.bytes_served.clear()
            self.tensor_bytes_served.clear()
            self.requests.clear()

    def count(self, repo_id: str, name: str, served: ServedFile, begin: int, end: int) -> None:
        with self.lock:
            self.bytes_served[(repo_id, name)] += end - begin
            if served.data_start is not None:
                self.data_starts[(repo_id, name)] = served.data_start
                self.tensor_bytes_served[(repo_id, name)] += max(0, end - max(begin, served.data_start))

    def total_tensor_bytes(self) -> int:
        return sum(self.tensor_bytes_served.values())

    def tensor_bytes_past_window(self, window) -> int:
        """Tensor-data bytes sent beyond what the client's speculative header reads may take (`window`: its
        trellis_cli.sources.HeaderWindow): per safetensors file, the data bytes past offset max(window.first,
        1.25 x the longest header among the files sent + window.margin). 0 when every data byte sent came with
        a header read: header-only commands assert it."""
        return sum(self.tensor_bytes_past_window_by_file(window).values())

    def tensor_bytes_past_window_by_file(self, window) -> dict[str, int]:
        """`tensor_bytes_past_window` per file name, for the files that have any."""
        with self.lock:
            starts = {key: self.data_starts[key] for key in self.bytes_served if key in self.data_starts}
            longest = max((start - 8 for start in starts.values()), default=0)
            allowance = max(window.first, longest * 5 // 4 + window.margin)
            past = {key[1]: n - max(0, allowance - starts[key]) for key, n in self.tensor_bytes_served.items()}
            return {name: n for name, n in past.items() if n > 0}


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def setup(self) -> None:
        super().setup()
        with self.hub.lock:
            self.hub.connections[threading.current_thread()] = self.connection

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.hub.lock:
                self.hub.connections.pop(threading.current_thread(), None)

    # -- plumbing ----------------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, *, head: bool = False,
              content_length: int | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)
        with self.hub.lock:
            self.hub.requests.append((self.command, self.path, self.headers.get("Range"), status))

    def _json(self, status: int, document, headers: dict | None = None, head: bool = False) -> None:
        body = json.dumps(document).encode()
        self._send(status, body, {"Content-Type": "application/json", **(headers or {})}, head=head)

    def _error(self, status: int, code: str | None, message: str, headers: dict | None = None,
               head: bool = False) -> None:
        extra = {"X-Error-Message": message, **(headers or {})}
        if code:
            extra["X-Error-Code"] = code
        self._json(status, {"error": message}, extra, head=head)

    def _authorized(self, repo: Repo) -> bool:
        needs_token = repo.private or repo.gated
        return not needs_token or self.headers.get("Authorization") == f"Bearer {self.hub.token}"

    def _repo(self, repo_id: str, head: bool = False) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", head=head)
            return None
        if not self._authorized(repo):
            if repo.gated:
                self._error(403, "GatedRepo", "Access to this model is restricted.", head=head)
            else:
                self._error(401, "RepoNotFound", "Invalid username or password.", head=head)
            return None
        return repo

    def _commit(self, repo: Repo, revision: str, head: bool = False) -> str | None:
        sha = repo.resolve(revision)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", head=head)
        return sha

    # -- routes ------------------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_POST(self) -> None:
        parts, query = self._split()
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode())
        if len(parts) == 6 and parts[:2] == ["api", "models"] and parts[4] == "paths-info":
            return self._paths_info(f"{parts[2]}/{parts[3]}", parts[5], form.get("paths", []))
        self._error(404, None, "no such route")

    def _split(self) -> tuple[list[str], dict]:
        url = urlsplit(self.path)
        return [unquote(p) for p in url.path.strip("/").split("/")], parse_qs(url.query)

    def _route(self, head: bool) -> None:
        if self.hub.stall is not None and self.hub.stall(self.path):
            self.hub._stopping.wait()
            return
        parts, query = self._split()
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            if not rest:
                return self._model_info(repo_id, "main", query, head)
            if rest[0] == "revision" and len(rest) == 2:
                return self._model_info(repo_id, rest[1], query, head)
            if rest[0] == "tree" and len(rest) >= 2:
                return self._tree(repo_id, rest[1], "/".join(rest[2:]), query, head)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
        if parts[0] == "lfs-blobs" and len(parts) >= 5:
            return self._blob(f"{parts[1]}/{parts[2]}", parts[3], "/".join(parts[4:]), head)
        self._error(404, None, "no such route", head=head)

    def _model_info(self, repo_id: str, revision: str, query: dict, head: bool) -> None:
        repo = self._repo(repo_id, head)
        if repo is None or (sha := self._commit(repo, revision, head)) is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        files = repo.commits[sha]
        self._json(200, {
            "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "sha": sha, "private": repo.private, "gated": False, "disabled": False, "downloads": 0, "likes": 0,
            "tags": [], "siblings": [f.sibling(name, blobs) for name, f in files.items()],
        }, head=head)

    def _tree(self, repo_id: str, revision: str, path: str, query: dict, head: bool) -> None:
        repo = self._repo(repo_id, head)
        if repo is None or (sha := self._commit(repo, revision, head)) is None:
            return
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{path}/" if path else ""
        entries: dict[str, dict] = {}
        for name, served in repo.commits[sha].items():
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):].split("/")
            for depth in range(1, len(rest)):  # the folders on the way
                folder = prefix + "/".join(rest[:depth])
                if recursive or depth == 1:
                    entries.setdefault(folder, {"type": "directory", "oid": _fake_oid(folder), "path": folder})
            if recursive or len(rest) == 1:
                entries[name] = served.entry(name)
        if path and not entries:
            return self._error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": sha}, head)
        self._json(200, sorted(entries.values(), key=lambda e: e["path"]), head=head)

    def _paths_info(self, repo_id: str, revision: str, paths: list[str]) -> None:
        repo = self._repo(repo_id)
        if repo is None or (sha := self._commit(repo, revision)) is None:
            return
        files = repo.commits[sha]
        out = []
        for path in paths:
            if path in files:
                out.append(files[path].entry(path))
            elif any(name.startswith(path.rstrip("/") + "/") for name in files):
                out.append({"type": "directory", "oid": _fake_oid(path), "path": path})
        self._json(200, out)

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo = self._repo(repo_id, head)
        if repo is None or (sha := self._commit(repo, revision, head)) is None:
            return
        served = repo.commits[sha].get(path)
        if served is None:
            return self._error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": sha}, head)
        common = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if served.lfs:
            location = f"/lfs-blobs/{quote(repo_id)}/{sha}/{quote(path)}"
            return self._send(302, b"", {**common, "Location": location, "ETag": f'"{served.git_sha1}"',
                                         "X-Linked-Etag": f'"{served.sha256}"',
                                         "X-Linked-Size": served.size}, head=head)
        self._body(repo_id, path, served, {**common, "ETag": f'"{served.git_sha1}"'}, head)

    def _blob(self, repo_id: str, sha: str, path: str, head: bool) -> None:
        # The "CDN" behind an LFS redirect: a signed URL on the real Hub, so no token check here.
        repo = self.hub.repos.get(repo_id)
        served = repo.commits.get(sha, {}).get(path) if repo else None
        if served is None:
            return self._error(404, None, "no such blob", head=head)
        self._body(repo_id, path, served, {"X-Repo-Commit": sha, "Accept-Ranges": "bytes",
                                           "ETag": f'"{served.sha256}"'}, head)

    def _body(self, repo_id: str, path: str, served: ServedFile, headers: dict, head: bool) -> None:
        size = served.size
        span = _parse_range(self.headers.get("Range") if self.hub.honour_ranges else None, size)
        if span == "unsatisfiable":
            return self._send(416, b"", {**headers, "Content-Range": f"bytes */{size}"}, head=head)
        if span is None:
            begin, end, status = 0, size, 200
        else:
            (begin, end), status = span, 206
            headers = {**headers, "Content-Range": f"bytes {begin}-{end - 1}/{size}"}
        self._send(status, b"", {**headers, "Content-Type": "application/octet-stream"}, head=head,
                   content_length=end - begin)
        if head:
            return
        self.hub.count(repo_id, path, served, begin, end)
        for chunk in served.chunks(begin, end):
            self.wfile.write(chunk)


def _parse_range(header: str | None, size: int):
    """(begin, end) with end exclusive, None for no/ignored Range, or "unsatisfiable"."""
    if not header:
        return None
    match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if not match or match.group(0).count(",") or (not match.group(1) and not match.group(2)):
        return None
    first, last = match.group(1), match.group(2)
    if not first:  # suffix: the last N bytes
        return max(0, size - int(last)), size
    begin = int(first)
    end = min(size, int(last) + 1) if last else size
    if begin >= size:
        return "unsatisfiable"
    return begin, end


def _fake_oid(path: str) -> str:
    return hashlib.sha1(f"tree:{path}".encode()).hexdigest()
