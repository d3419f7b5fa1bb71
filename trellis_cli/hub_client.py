"""The one place that talks to huggingface_hub: error mapping, version differences, progress adapters.

huggingface_hub 1.x uses httpx and 2.x uses httpx2; the public API trellis needs (HfApi.model_info,
hf_hub_download, hf_hub_url, try_to_load_from_cache, is_offline_mode, get_token, and utils.get_session /
build_hf_headers for ranged reads) is the same in both.
Anything that differs is feature-detected here so the rest of trellis never checks versions.

Every Hub call runs inside `hub_errors(...)`, which turns the library's exceptions into one
SourceUnavailable (exit 3) with a one-line message and a hint. Tokens never appear in messages.
"""

from __future__ import annotations

import importlib
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import huggingface_hub
from huggingface_hub import constants as hf_constants
from huggingface_hub import errors as hf_errors

from trellis_cli.errors import SourceUnavailable

COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
AUTH_HINT = "if the repo is private or gated, set HF_TOKEN or run `hf auth login`"
OFFLINE_HINT = "offline mode is on (HF_HUB_OFFLINE=1 or --offline); fetch it once online to fill the cache"

ProgressCallback = Callable[[int], None]  # called with the number of bytes just processed


def _transport_errors() -> tuple[type[BaseException], ...]:
    # 1.x raises httpx.TransportError subclasses, 2.x httpx2's; import whichever is installed.
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            found.append(importlib.import_module(module).TransportError)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


TRANSPORT_ERRORS = _transport_errors()
_RESOLUTION_ERROR = getattr(hf_errors, "RevisionResolutionError", None)


_timeouts_installed = False


def request_timeouts() -> tuple[float, float]:
    """(connect, read) seconds for every Hub request: the library's HF_HUB_ETAG_TIMEOUT and
    HF_HUB_DOWNLOAD_TIMEOUT settings (10 s each by default), read when huggingface_hub is imported."""
    return float(hf_constants.HF_HUB_ETAG_TIMEOUT), float(hf_constants.HF_HUB_DOWNLOAD_TIMEOUT)


def install_timeouts() -> None:
    """Bound the connect and read time of every request the library's shared HTTP client sends.

    API calls such as model_info pass `timeout=None`, which means "wait forever", and a metadata request that
    timed out is retried once with a 60 s limit: a server that accepts the connection and never answers would
    hang `inspect` for good or for minutes. A request hook caps every limit the request carries to the
    transport at the configured ones (10 s by default). Idempotent.
    """
    global _timeouts_installed
    set_factory = getattr(huggingface_hub, "set_client_factory", None)
    default_factory = getattr(importlib.import_module("huggingface_hub.utils._http"), "default_client_factory", None)
    if _timeouts_installed or set_factory is None or default_factory is None:
        return
    connect, read = request_timeouts()
    read = max(connect, read)  # metadata requests use the etag limit, downloads the download limit
    bounds = {"connect": connect, "read": read, "write": read, "pool": connect}

    def bound(request) -> None:
        limits = dict(request.extensions.get("timeout") or {})
        request.extensions["timeout"] = {key: min(limits.get(key) or cap, cap) for key, cap in bounds.items()}

    def bounded_client():
        client = default_factory()
        client.event_hooks["request"] = [*client.event_hooks.get("request", []), bound]
        return client

    set_factory(bounded_client)
    _timeouts_installed = True


def is_offline(offline: bool | None) -> bool:
    """An explicit choice wins; otherwise the library's own HF_HUB_OFFLINE reading."""
    if offline is not None:
        return offline
    check = getattr(huggingface_hub, "is_offline_mode", None)  # public since 1.3
    return bool(check()) if check is not None else bool(hf_constants.HF_HUB_OFFLINE)


def default_endpoint() -> str:
    return hf_constants.ENDPOINT


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir if cache_dir is not None else hf_constants.HF_HUB_CACHE).expanduser()


def repo_cache_folder(repo_id: str, cache_dir: str | os.PathLike | None) -> Path:
    """The cache folder of a model repo: models--org--name (the layout documented for the Hub cache)."""
    return cache_root(cache_dir) / ("models--" + repo_id.replace("/", "--"))


def resolve_cached_revision(repo_id: str, revision: str | None, cache_dir) -> str | None:
    """The commit sha the local cache holds for `revision` (a sha, or refs/<branch|tag>), or None."""
    folder = repo_cache_folder(repo_id, cache_dir)
    rev = revision or hf_constants.DEFAULT_REVISION
    if COMMIT_SHA.fullmatch(rev):
        return rev if (folder / "snapshots" / rev).is_dir() else None
    ref = folder / "refs" / rev
    try:
        sha = ref.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return sha if COMMIT_SHA.fullmatch(sha) and (folder / "snapshots" / sha).is_dir() else None


def describe_target(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id


@contextmanager
def hub_errors(repo_id: str, revision: str | None, endpoint: str | None, *, file: str | None = None) -> Iterator[None]:
    """Map huggingface_hub failures to SourceUnavailable with one clear line (order matters: subclasses first)."""
    target = describe_target(repo_id, revision)
    where = f"{file} in {target}" if file else target
    try:
        yield
    except SourceUnavailable:
        raise
    except hf_errors.GatedRepoError as e:
        raise SourceUnavailable(f"{repo_id} is gated: request access on its Hub page, then {AUTH_HINT}") from e
    except hf_errors.RepositoryNotFoundError as e:
        status = _status(e)
        reason = "access denied (401)" if status == 401 else "repository not found"
        raise SourceUnavailable(f"{repo_id}: {reason} at {endpoint or default_endpoint()} ({AUTH_HINT})") from e
    except hf_errors.RevisionNotFoundError as e:
        raise SourceUnavailable(
            f"{repo_id}: revision {revision!r} not found (use a branch, tag or full commit sha)"
        ) from e
    except hf_errors.OfflineModeIsEnabled as e:
        raise SourceUnavailable(f"{where}: not in the local Hub cache and {OFFLINE_HINT}") from e
    except hf_errors.LocalEntryNotFoundError as e:
        timeout = _timeout_cause(e)
        if timeout is not None:  # the library fell back to the cache because the server did not answer
            raise SourceUnavailable(_unreachable(where, endpoint, timeout)) from e
        raise SourceUnavailable(f"{where}: not in the local Hub cache and the Hub could not be reached") from e
    except hf_errors.EntryNotFoundError as e:
        raise SourceUnavailable(f"{where}: no such file in the repository") from e
    except hf_errors.HfHubHTTPError as e:
        status = _status(e)
        if status in (401, 403):
            raise SourceUnavailable(f"{where}: access denied ({status}); {AUTH_HINT}") from e
        raise SourceUnavailable(f"{where}: Hub request failed (HTTP {status})") from e
    except TRANSPORT_ERRORS as e:
        raise SourceUnavailable(_unreachable(where, endpoint, e)) from e
    except Exception as e:
        if _RESOLUTION_ERROR is None or not isinstance(e, _RESOLUTION_ERROR):
            raise
        # resolve_revision fell back to the cache and found nothing; its cause says why it went there.
        cause = e.__cause__
        if cause is None or isinstance(cause, hf_errors.OfflineModeIsEnabled):
            raise SourceUnavailable(f"{where}: revision not in the local Hub cache and {OFFLINE_HINT}") from e
        if isinstance(cause, hf_errors.HfHubHTTPError):
            raise SourceUnavailable(f"{where}: Hub request failed (HTTP {_status(cause)})") from e
        raise SourceUnavailable(_unreachable(where, endpoint, cause)) from e


def _unreachable(where: str, endpoint: str | None, error: BaseException) -> str:
    if _is_timeout(error):
        connect, read = request_timeouts()
        return (f"{where}: {endpoint or default_endpoint()} did not answer in time ({type(error).__name__}; limits: "
                f"connect {connect:g} s, read {read:g} s, set by HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT); "
                "try again later, or use --offline to read from the local Hub cache")
    return (
        f"{where}: cannot reach {endpoint or default_endpoint()} ({type(error).__name__}); "
        "check the network, or use --offline to read from the local Hub cache"
    )


def _is_timeout(error: BaseException) -> bool:
    return isinstance(error, TimeoutError) or "Timeout" in type(error).__name__


def _timeout_cause(error: BaseException) -> BaseException | None:
    """The timeout among the exceptions that led to `error`, if one did."""
    seen = error.__cause__ or error.__context__
    while seen is not None:
        if _is_timeout(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def read_range(repo_id: str, filename: str, revision: str, endpoint: str | None, token: str | bool | None,
               start: int, length: int) -> bytes:
    """Bytes [start, start + length) of a file at a pinned commit: one ranged GET of the file's resolve URL,
    through the library's shared HTTP client (its timeouts, headers and token), redirects followed.

    Fail-closed: an answer other than 206 for exactly that range, or more bytes than asked, is a
    SourceUnavailable; the body is read only up to `length` (a server that ignores the Range header is cut off
    there). Fewer bytes than asked come back as they are: the caller knows how many the file has. Transport
    errors propagate for `hub_errors` to map.
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    where = f"{filename} in {describe_target(repo_id, revision)}"
    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint)
    headers = build_hf_headers(token=token)
    headers["Range"] = f"bytes={start}-{start + length - 1}"
    with get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
        status = response.status_code
        if status == 200:
            raise SourceUnavailable(f"{where}: the server ignored the byte-range request (HTTP 200 for the whole "
                                    "file); not read")
        if status != 206:
            raise SourceUnavailable(_range_refusal(where, repo_id, revision, endpoint, status,
                                                   response.headers.get("X-Error-Code")))
        answered = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
        if answered is None or int(answered.group(1)) != start or int(answered.group(2)) > start + length - 1:
            raise SourceUnavailable(f"{where}: the server answered another byte range "
                                    f"({response.headers.get('Content-Range') or 'no Content-Range'}) than "
                                    f"bytes {start}-{start + length - 1}")
        data = bytearray()
        for chunk in response.iter_bytes():
            data += chunk
            if len(data) > length:
                raise SourceUnavailable(f"{where}: the server sent more than the {length} bytes asked for")
    return bytes(data)


def _range_refusal(where: str, repo_id: str, revision: str, endpoint: str | None, status: int,
                   error_code: str | None) -> str:
    """What a failed ranged read says, as `hub_errors` says it for the library's own requests."""
    if error_code == "GatedRepo":
        return f"{repo_id} is gated: request access on its Hub page, then {AUTH_HINT}"
    if error_code == "RepoNotFound":
        return f"{repo_id}: repository not found at {endpoint or default_endpoint()} ({AUTH_HINT})"
    if error_code == "RevisionNotFound":
        return f"{repo_id}: revision {revision!r} not found (use a branch, tag or full commit sha)"
    if error_code == "EntryNotFound" or status == 404:
        return f"{where}: no such file in the repository"
    if status in (401, 403):
        return f"{where}: access denied ({status}); {AUTH_HINT}"
    return f"{where}: Hub request failed (HTTP {status})"


def quiet_library_logs() -> None:
    """The library logs each retry as a warning on stderr; trellis reports the outcome as its one line."""
    logging_module = getattr(getattr(huggingface_hub, "utils", None), "logging", None)
    set_error = getattr(logging_module, "set_verbosity_error", None)
    if set_error is not None:
        set_error()


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


class CallbackBar:
    """A tqdm stand-in that forwards byte counts to a callback and draws nothing.

    hf_hub_download(tqdm_class=...) builds one per file and calls update(n) per received chunk; it is not a
    tqdm subclass, so the library passes only tqdm's own keyword arguments and never prints a bar.
    """

    callback: ProgressCallback | None = None

    def __init__(self, *args, **kwargs) -> None:
        self.total = kwargs.get("total")
        self.n = kwargs.get("initial", 0) or 0
        if self.n and self.callback is not None:
            self.callback(int(self.n))

    @classmethod
    def bound_to(cls, callback: ProgressCallback) -> type["CallbackBar"]:
        return type("BoundCallbackBar", (cls,), {"callback": staticmethod(callback)})

    def update(self, n: int | float | None = 1) -> None:
        n = int(n or 0)
        self.n += n
        if self.callback is not None and n:
            self.callback(n)

    def __enter__(self) -> "CallbackBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def refresh(self, *args, **kwargs) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass

    set_description_str = set_postfix_str = set_postfix = set_description
