"""Checkpoint folders in object storage: `--checkpoint-dir s3://bucket/prefix` (gs://, az://, ...),
through fsspec (imported only for a URL), with credentials from the environment, never the URL.
With no rename there, a file is one upload (whole or absent), and a folder is complete once its
`meta.json`, written last, is there (docs/recovery.md). `file://` URLs are plain local paths."""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import unquote, urlsplit

from ..failures import RunFailure, UsageError, bounded
from ..runtime.workarounds import CLEANUPS

INSTALL = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs",
           "abfs": "adlfs", "abfss": "adlfs"}
UPLOAD_TRIES = 3  # a failing upload is tried this often, with a growing pause, then the run stops
_cache: tempfile.TemporaryDirectory | None = None
_copies: dict[str, Path] = {}  # local_copy: each URL once, downloaded under _cache


def is_url(value: str) -> bool:
    return "://" in str(value) and not str(value).startswith("file://")


def url_problem(value: str) -> str | None:
    """Why a URL given as a checkpoint location cannot be used (None for plain paths)."""
    if "://" not in value:
        return None
    parts = urlsplit(value)
    if parts.username or parts.password or "@" in parts.netloc or parts.query:
        return ("credentials do not go in the URL (they would be written to config.json and the "
                "logs); give them through the environment, e.g. AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or a profile")
    if parts.scheme == "file":
        return None if parts.netloc in ("", "localhost") else (
            "file:// URLs take three slashes (file:///abs/path); or give a plain path")
    import fsspec
    if parts.scheme not in fsspec.available_protocols():
        return f"unknown storage scheme {parts.scheme}://; use s3://, gs://, az:// or a path"
    if not parts.netloc:
        return f"no bucket: write {parts.scheme}://BUCKET/PREFIX"
    if package := INSTALL.get(parts.scheme):
        try:
            importlib.import_module(package)
        except ImportError:
            return _install(parts.scheme, package)
    return None


def _install(scheme: str, package: str) -> str:
    extra = ' (the project\'s extra: pip install -e ".[s3]")' if package == "s3fs" else ""
    return f"{scheme}:// needs {package}: pip install {package}{extra}"


def redact(value: str) -> str:
    """A URL as it may be shown: without user, password or query."""
    if "://" not in value:
        return value
    parts = urlsplit(value)
    return f"{parts.scheme}://{parts.hostname or ''}{parts.path}"


def location(value: str | Path | RemotePath) -> Path | RemotePath:
    """The checkpoint folder or file a flag names: a RemotePath for a URL, else a Path."""
    if not isinstance(value, str):
        return value
    if value.startswith("file://"):
        return Path(unquote(urlsplit(value).path))
    return RemotePath(value) if is_url(value) else Path(value)


def given(value: str) -> AnyPath:
    """`location` of a path or URL a user typed; a URL that cannot work is one UsageError."""
    if why := url_problem(value):
        raise UsageError(f"{redact(value)}: {why}")
    return location(value)


def shown(value: str) -> str:
    """How a checkpoint location is printed: a URL as given, a path made absolute."""
    return redact(value) if is_url(value) else str(Path(value).resolve())


def filesystem(url: str) -> Any:
    """The fsspec filesystem for `url`; one line saying what to install when it is missing."""
    import fsspec
    scheme = url.split("://", 1)[0]
    kwargs: dict[str, Any] = {"use_listings_cache": False}  # other ranks write here too
    if INSTALL.get(scheme) == "s3fs":
        # Bounded waits: a silent endpoint ends in an error line, not a hang.
        kwargs["config_kwargs"] = {"connect_timeout": 10, "read_timeout": 60,
                                   "retries": {"max_attempts": 4, "mode": "standard"}}
    try:
        return fsspec.filesystem(scheme, **kwargs)
    except ImportError:
        raise UsageError(_install(scheme, INSTALL.get(scheme, "its fsspec package"))) from None


class RemotePath:
    """The `pathlib.Path` operations checkpoints use, on an fsspec filesystem."""

    def __init__(self, url: str, fs: Any = None) -> None:
        self.url, self.fs = url.rstrip("/"), fs if fs is not None else filesystem(url)
        self.key = self.url.split("://", 1)[1]

    def __str__(self) -> str:
        return self.url

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.fs)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rsplit("/", 1)[0], self.fs)

    def resolve(self) -> RemotePath:
        return self

    def exists(self) -> bool:
        return self.fs.exists(self.key)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.key)

    def is_file(self) -> bool:
        return self.fs.isfile(self.key)

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=self.fs.size(self.key))

    def iterdir(self) -> list[RemotePath]:
        return [self / entry.rstrip("/").rsplit("/", 1)[-1]
                for entry in self.fs.ls(self.key, detail=False)]

    def glob(self, pattern: str) -> list[RemotePath]:
        return [self / entry.rsplit("/", 1)[-1] for entry in self.fs.glob(f"{self.key}/{pattern}")]

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: an object store's folders are the prefixes of its keys."""

    def read_text(self) -> str:
        return self.fs.cat_file(self.key).decode()

    def write_text(self, text: str) -> None:
        self.fs.pipe_file(self.key, text.encode())

    def age_s(self) -> float:
        """Seconds since the newest object under this path was written."""
        times = [info.get("LastModified") or info.get("mtime") or info.get("last_modified")
                 for info in self.fs.find(self.key, detail=True).values()] or [None]
        newest = max(t.timestamp() if hasattr(t, "timestamp") else float(t or 0) for t in times)
        return time.time() - newest if newest else 0.0


AnyPath = Path | RemotePath


def remove(path: AnyPath) -> None:
    if isinstance(path, RemotePath):
        path.fs.rm(path.key, recursive=path.is_dir())
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def move(source: AnyPath, target: AnyPath) -> None:
    """Rename locally; copy then delete in an object store (the source stays until copied)."""
    if not isinstance(source, RemotePath):
        os.replace(source, target)
    elif not source.is_dir():
        source.fs.mv(source.key, target.key)
    else:
        for key in source.fs.find(source.key):  # object by object: a folder is only a prefix
            source.fs.copy(key, f"{target.key}{key[len(source.key):]}")
        source.fs.rm(source.key, recursive=True)


def upload(local: Path, target: RemotePath, newest: str, timeout_s: float) -> None:
    """Put a file at `target`, each try within `timeout_s`; the final error names `newest`."""
    for attempt in range(1, UPLOAD_TRIES + 1):
        failure = within(lambda: target.fs.put_file(str(local), target.key), timeout_s)
        if failure is None:
            return
        if attempt == UPLOAD_TRIES or isinstance(failure, TimeoutError):
            tries = "" if isinstance(failure, TimeoutError) else f" after {UPLOAD_TRIES} tries"
            raise RunFailure(f"cannot upload checkpoint {target}{tries} ({reason(failure)}); "
                             f"{newest}") from None
        time.sleep(2 ** attempt)


def within(job: Callable[[], Any], timeout_s: float) -> BaseException | None:
    """`job` on a thread of its own (failures.bounded): None, its exception, or a TimeoutError
    when the storage has not answered within `timeout_s` (a host that vanished)."""
    def caught() -> BaseException | None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - a value: bounded's TimeoutError is silence
            return exc
        return None

    try:
        return bounded(caught, timeout_s)
    except TimeoutError:
        return TimeoutError(f"the storage did not answer within {timeout_s:.0f} s (--timeout-s)")


def local_copy(path: AnyPath) -> Path:
    """A local path to read `path` from: itself, or a download kept until the process ends."""
    global _cache
    if not isinstance(path, RemotePath):
        return path
    if path.url not in _copies:
        if _cache is None:
            _cache = tempfile.TemporaryDirectory(prefix="ckpt-download-")
            atexit.register(_cache.cleanup)
            CLEANUPS.append(_cache.cleanup)  # training processes end without atexit's handlers
        target = Path(_cache.name) / str(len(_copies)) / path.name
        target.parent.mkdir(parents=True)
        path.fs.get(path.key, str(target), recursive=path.is_dir())
        _copies[path.url] = target
    return _copies[path.url]


def _chain(exc: BaseException | None) -> list[BaseException]:
    """An exception and those it was raised from (s3fs wraps botocore's, which carry codes)."""
    found: list[BaseException] = []
    while exc is not None and exc not in found:
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def reason(exc: BaseException) -> str:
    """What went wrong, as words and the service's error code, from an fsspec/botocore error."""
    for seen in _chain(exc):
        if failures := getattr(seen, "failures", None):  # DCP's: {rank: (exception, trace)}
            return reason(next(iter(failures.values()))[0])
        error = (getattr(seen, "response", None) or {}).get("Error", {})
        if error.get("Code"):
            return f"{error['Code']}: {(error.get('Message') or '').strip()}".rstrip(": ")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def diagnosis(url: str, exc: BaseException) -> str:
    """`reason(exc)` as the cause a user can fix: bucket, credentials, permissions, network."""
    why, names = reason(exc), {type(e).__name__ for e in _chain(exc)}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if "NoSuchBucket" in why:
        return f"no such bucket '{urlsplit(url).netloc}' ({why}); create it, or fix the URL"
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        return ("no credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or "
                "AWS_PROFILE, or run where an instance or pod role gives them")
    if any(code in why for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch",
                                    "ExpiredToken", "InvalidToken", "InvalidClientTokenId")):
        return (f"the credentials were refused ({why}); check AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY and AWS_PROFILE")
    if "AccessDenied" in why or isinstance(exc, PermissionError):
        return (f"cannot write there ({why}): these credentials may only read this prefix; grant "
                "them s3:PutObject and s3:DeleteObject on it, or choose another prefix")
    if names & {"EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError",
                "ConnectionRefusedError", "ConnectionError", "ReadTimeoutError",
                "ServerTimeoutError", "TimeoutError"}:
        where = f"the endpoint {endpoint}" if endpoint else "the storage endpoint"
        return f"cannot reach {where} ({why}); check AWS_ENDPOINT_URL and the network"
    return why
