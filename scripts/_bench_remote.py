"""The remote backend for the benchmarks: an S3 server on 127.0.0.1 (moto's, in a process of its own), and an ssd cache
folder uploaded into a bucket on it with the index precompute would leave (`scripts/bench_startup.py
--backend remote`). Needs the dev extra (s3fs, moto[server])."""

from __future__ import annotations

import os
import socket
from pathlib import Path

BUCKET = "qie-bench"


class ServerProcess:
    """moto's S3 server in a process of its own (the benchmark's client and server then use a core each); setting
    `latency` (seconds) makes it hold every later request that long before it answers."""

    def __init__(self, port: int, folder: Path) -> None:
        import subprocess
        import sys

        self.port, self._latency_file = port, folder / "latency"
        self._latency_file.write_text("0")
        cmd = [sys.executable, os.path.abspath(__file__), "--serve", str(port), str(self._latency_file)]
        self._proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    @property
    def latency(self) -> float:
        return float(self._latency_file.read_text())

    @latency.setter
    def latency(self, seconds: float) -> None:
        tmp = self._latency_file.with_suffix(".tmp")
        tmp.write_text(repr(float(seconds)))
        os.replace(tmp, self._latency_file)

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(30)


def serve(port: int, latency_file: str) -> None:
    """The server process: moto's S3 app on 127.0.0.1:`port`, each request held the seconds `latency_file` says
    (read again when the file changes)."""
    import logging
    import time

    from moto.moto_server import threaded_moto_server as served
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    seen: list = [None, 0.0]

    def latency() -> float:
        stamp = os.stat(latency_file).st_mtime_ns
        if stamp != seen[0]:
            seen[:] = [stamp, float(Path(latency_file).read_text())]
        return seen[1]

    make = served.make_server

    def delayed(ip, port, app, *a, **k):
        def slow(environ, start_response):
            wait = latency()
            if wait:
                time.sleep(wait)
            return app(environ, start_response)

        return make(ip, port, slow, *a, **k)

    served.make_server = delayed
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    while True:
        time.sleep(3600)


def start_server(folder: Path | None = None) -> tuple[ServerProcess, str]:
    """(the server, its endpoint URL), with a bucket `BUCKET`, and test credentials in the environment (which the
    benchmark's child processes and the server inherit). `folder` holds the server's latency file (default: a
    temporary one). Once `server.latency = seconds` is set (after filling the bucket), the server holds every
    request that long before it answers: a far-away object store."""
    import tempfile
    import time

    import s3fs

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ServerProcess(port, Path(folder or tempfile.mkdtemp(prefix="qie_bench_s3_")))
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"the S3 server on port {port} did not start within 60 s") from None
            time.sleep(0.1)
    s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True).mkdir(BUCKET)
    return server, endpoint


def upload(cache: Path, endpoint: str, prefix: str, types: tuple[str, ...]) -> str:
    """Copy the entry files of `types` under `cache` to `s3://BUCKET/prefix` (concurrent PUTs) and write their
    index; returns the cache URL."""
    from qie.cache.remote import RemoteBackend, _record

    url = f"s3://{BUCKET}/{prefix}"
    backend = RemoteBackend(url=url, endpoint_url=endpoint, local_dir=cache.parent / "upload-copy")
    backend.check_access(write=True)
    fs = backend.store.fs
    for t in types:
        files = sorted(str(p) for p in (cache / t).glob("*/*.safetensors"))
        names = [f"{backend.store.root}/{Path(f).relative_to(cache).as_posix()}" for f in files]
        fs.put(files, names)
        for f in files:
            with open(f, "rb") as fh:
                data = fh.read()
            backend.index.add(t, Path(f).name.removesuffix(".safetensors"), _record(data, t))
    backend.flush()
    return url


def overrides(url: str, endpoint: str, local: Path) -> list[str]:
    """Train-stage overrides reading the cache at `url` through a node-local copy in `local` (fresh per run)."""
    return ["cache=remote", f"cache.url={url}", f"cache.endpoint_url={endpoint}", f"cache.local_dir={local}"]


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]), sys.argv[3])
