"""An object store seen through fsspec, as the `remote` backend uses it: every call bounded by retries with
backoff, every failure turned into a StorageError naming the endpoint, and a count of the requests made.

Paths are relative to the store's root (`url`'s bucket and prefix); nothing outside the root is ever named.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from qie.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

# Failures that a later try may not meet again: the connection, a timeout, a server that is busy.
_TRANSIENT_NAMES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ProxyConnectionError",
    "ResponseStreamingError",
    "IncompleteReadError",
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
}
_TRANSIENT_ERRNOS = (errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EHOSTUNREACH)
_DENIED_WORDS = (
    "NoCredentialsError",
    "Unable to locate credentials",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "Forbidden",
)


def plain(value: Any) -> Any:
    """`value` with every mapping turned into a dict and every list-like into a list (config nodes included)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [plain(v) for v in value]
    return value


def open_store(
    group: str, url: str, endpoint_url: str | None, storage_options: Mapping | None, requests: tuple[int, float, float]
) -> Store:
    """The store at `url` (the setting named in errors: `cache.backend.url`, `run.output_url`), its client opened
    again in forked processes; `requests` is (retries, backoff, timeout) per request.

    Raises:
        ConfigError: a URL that cannot be opened (no s3fs), or a bucket without a prefix.
    """
    retries, backoff, timeout = requests
    setting = "cache.backend.url" if group == "cache" else f"{group}.output_url"
    where = url + (f" at {endpoint_url}" if endpoint_url else "")

    def reopen():
        return open_filesystem(url, endpoint_url, storage_options, float(timeout))

    try:
        fs, root = reopen()
    except (ImportError, ValueError) as e:
        raise ConfigError(f"{setting}={url!r} cannot be opened ({e}): for s3:// URLs pip install 'qie[s3]'") from None
    if "/" not in root.strip("/") and url.startswith(("s3://", "gs://", "gcs://", "az://", "abfs://")):
        raise ConfigError(f"{setting}={url!r} names a bucket without a prefix: use s3://BUCKET/PREFIX")
    store = Store(fs, root, where, retries, backoff, reopen)
    store.settings = group
    return store


def open_filesystem(url: str, endpoint_url: str | None, storage_options: Mapping | None, timeout: float):
    """(fsspec file system, root path without the scheme) for `url`. For s3:// the client makes one try per
    call (the store retries), has `timeout` seconds to connect, and caches no listings (other nodes write)."""
    import fsspec

    options = plain(storage_options or {})
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        if endpoint_url:
            options["endpoint_url"] = endpoint_url
        options.setdefault("use_listings_cache", False)
        config = options.setdefault("config_kwargs", {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", max(timeout, 30))
        config.setdefault("retries", {"max_attempts": 1})
    elif protocol in ("file", "local"):  # a folder stands in for a bucket: make the folders objects sit in
        options.setdefault("auto_mkdir", True)
    elif endpoint_url:
        options.setdefault("endpoint_url", endpoint_url)
    options.setdefault("skip_instance_cache", True)
    fs, root = fsspec.url_to_fs(url, **options)
    if protocol in ("s3", "s3a"):
        fs.retries = 1  # s3fs's own retry loop: one try, the store's loop retries
    return fs, root.rstrip("/")


class Store:
    """Bytes under names relative to `root` on `fs`, with retries and one-line errors.

    Args:
        fs, root: from `open_filesystem`.
        where: how errors name the store (its url and endpoint).
        retries: tries of a call that fails on the connection (at least 1); the waits between them double from
            `backoff` seconds.
        reopen: opens the file system again (as `open_filesystem`), in a forked process.
    """

    settings = "cache"  # the config group errors send the user to (`run` for a run's outputs)

    def __init__(
        self, fs, root: str, where: str, retries: int = 4, backoff: float = 0.5, reopen: Callable | None = None
    ) -> None:
        self._fs, self.root, self.where, self._reopen = fs, root, where, reopen
        self._pid = os.getpid()
        self.retries, self.backoff = max(1, int(retries)), float(backoff)
        self.requests = 0  # calls made to the store (each try counts): tests count them
        self._lock = threading.Lock()

    @property
    def fs(self):
        """The file system; a process forked from the one that opened it (a loader worker) opens its own: the
        client's connections and event loop belong to the parent."""
        if self._pid != os.getpid() and self._reopen is not None:
            self._fs, self._pid = self._reopen()[0], os.getpid()
        return self._fs

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    @property
    def local(self) -> bool:
        """Whether the store is a folder of this machine (`file://`): its links could lead out of it."""
        protocol = self._fs.protocol
        return bool({"file", "local"} & ({protocol} if isinstance(protocol, str) else set(protocol)))

    def call(self, what: str, fn: Callable, *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` with retries on transient failures. FileNotFoundError and FileExistsError pass
        through; any other failure ends as a StorageError naming the store and `what` was done."""
        for attempt in range(self.retries):
            with self._lock:
                self.requests += 1
            try:
                return fn(*args, **kwargs)
            except (FileNotFoundError, FileExistsError):
                raise
            except Exception as e:
                kind = classify(e)
                if kind != "transient":
                    raise StorageError(self._message(what, e, kind)) from None
                if attempt + 1 == self.retries:
                    raise StorageError(self._message(what, e, f"unreachable after {self.retries} tries")) from None
                wait = self.backoff * 2**attempt
                log.warning("%s: %s failed (%s); retrying in %.1f s", self.where, what, _short(e), wait)
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _message(self, what: str, e: Exception, kind: str) -> str:
        group = self.settings
        if kind == "denied":
            hint = "check the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or storage_options)"
        elif kind.startswith("unreachable"):
            hint = f"check {group}.endpoint_url and that the server is up and reachable from this machine"
        else:
            hint = f"check {group}.url, {group}.endpoint_url and {group}.storage_options"
        return f"object store {self.where}: {what} failed ({kind}: {_short(e)}): {hint}"

    # --- the operations the backend uses --------------------------------------------------------------------

    def read(self, name: str) -> bytes:
        """The object's bytes (FileNotFoundError when there is none)."""
        return self.call(f"reading {name}", self.fs.cat_file, self.path(name))

    def read_many(self, names: list[str]) -> dict[str, bytes | None]:
        """Each object's bytes (None where there is none), the reads made at once (one call of the file system);
        an object whose read failed otherwise is read again alone, with retries (`read`)."""
        paths = {self.fs._strip_protocol(self.path(n)): n for n in names}
        got = self.call(f"reading {len(names)} objects", self.fs.cat, list(paths), on_error="return") if names else {}
        out: dict[str, bytes | None] = {}
        for path, name in paths.items():
            data = got.get(path)
            if isinstance(data, FileNotFoundError):
                out[name] = None
            elif isinstance(data, bytes | bytearray):
                out[name] = bytes(data)
            else:  # an error of its own (or none reported): through the retries
                try:
                    out[name] = self.read(name)
                except FileNotFoundError:
                    out[name] = None
        return out

    def read_range(self, name: str, start: int, end: int) -> bytes:
        return self.call(f"reading {name}", self.fs.cat_file, self.path(name), start=start, end=end)

    def write(self, name: str, data: bytes) -> None:
        """Store `data` under `name` in one request (the object appears whole or not at all)."""
        self.call(f"writing {name}", self.fs.pipe_file, self.path(name), data)

    def create(self, name: str, data: bytes) -> bool:
        """Store `data` only when nothing is stored under `name` (`If-None-Match: *` on S3); False otherwise."""
        try:
            self.call(f"creating {name}", self.fs.pipe_file, self.path(name), data, mode="create")
        except FileExistsError:
            return False
        return True

    def size(self, name: str) -> int | None:
        """The object's size, or None when there is none."""
        try:
            return int(self.call(f"looking up {name}", self.fs.info, self.path(name))["size"])
        except FileNotFoundError:
            return None

    def remove(self, name: str) -> bool:
        """Delete the object; False when it was not there."""
        try:
            self.call(f"deleting {name}", self.fs.rm_file, self.path(name))
        except FileNotFoundError:
            return False
        return True

    def listing(self, folder: str) -> dict[str, int]:
        """{name relative to the root: size} of every object under `folder/` (recursively)."""
        base = self.path(folder).rstrip("/") + "/"
        try:
            found = self.call(f"listing {folder}/", self.fs.find, base, detail=True)
        except FileNotFoundError:
            return {}
        cut = len(self.root) + 1
        return {p[cut:]: int(info.get("size") or 0) for p, info in found.items() if p.startswith(base)}


def classify(e: Exception) -> str:
    """One of "transient" (worth another try), "denied" (credentials) or "failed" (anything else)."""
    names = {c.__name__ for c in type(e).__mro__}
    text = str(e)
    if isinstance(e, PermissionError) or any(w in text for w in _DENIED_WORDS):
        return "denied"
    if names & _TRANSIENT_NAMES or isinstance(e, (ConnectionError, TimeoutError)):
        return "transient"
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return "transient"
    if any(n in text for n in ("Could not connect", "Connect timeout", "Connection refused", "SlowDown", "503")):
        return "transient"
    return "failed"


def _short(e: Exception) -> str:
    text = " ".join(str(e).split()) or e.__class__.__name__
    return text if len(text) <= 200 else text[:197] + "..."
