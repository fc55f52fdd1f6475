"""The remote backend for the benchmarks: an S3 server on 127.0.0.1 (moto's, in a process of its own), and an ssd cache
folder uploaded into a bucket on it with the index precompute would leave (`scripts/bench_startup.py
--backend remote`). Needs the dev extra (s3fs, moto[server]).

Up to `PUT_LIMIT` entry files are uploaded with PUT requests; a bigger cache (a million entries would take hours of
requests) is put into the server's store by the server process itself (`ServerProcess.fill`: the same objects, the
same bucket, no HTTP), and its index is written by the client through the backend, as precompute writes it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

BUCKET = "qie-bench"
PUT_LIMIT = 10_000  # entry files uploaded by PUT requests; more are put by the server process


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

    def fill(self, cache: Path, prefix: str, types: tuple[str, ...]) -> int:
        """Put the entry files of `types` under `cache` into `BUCKET/prefix` from inside the server process;
        returns how many."""
        import json
        import time

        folder = self._latency_file.parent
        done = folder / "fill.done"
        done.unlink(missing_ok=True)
        request = folder / "fill.json"
        tmp = request.with_suffix(".tmp")
        tmp.write_text(json.dumps({"cache": str(cache), "bucket": BUCKET, "prefix": prefix, "types": list(types)}))
        os.replace(tmp, request)
        while not done.exists():
            if self._proc.poll() is not None:
                raise RuntimeError("the S3 server stopped while it filled the bucket")
            time.sleep(0.5)
        answer = json.loads(done.read_text())
        if "error" in answer:
            raise RuntimeError(f"the S3 server could not fill the bucket: {answer['error']}")
        return int(answer["count"])

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
    request = Path(latency_file).with_name("fill.json")
    while True:
        if request.exists():
            _fill(request)
        time.sleep(0.2)


def _fill(request: Path) -> None:
    """Do a fill request of `ServerProcess.fill` in the server process: each entry file becomes an object of the
    server's store, put as a PUT request would put it; the answer is written beside the request."""
    import json

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    job = json.loads(request.read_text())
    request.unlink()
    try:
        store, cache, count = s3_backends[DEFAULT_ACCOUNT_ID]["aws"], Path(job["cache"]), 0
        for t in job["types"]:
            for shard in sorted((cache / t).iterdir()):
                for f in sorted(shard.glob("*.safetensors")):
                    store.put_object(job["bucket"], f"{job['prefix']}/{t}/{shard.name}/{f.name}", f.read_bytes())
                    count += 1
        answer = {"count": count}
    except Exception as e:  # reported to the client, which raises it
        answer = {"error": f"{e.__class__.__name__}: {e}"}
    tmp = request.with_name("fill.tmp")
    tmp.write_text(json.dumps(answer))
    os.replace(tmp, request.with_name("fill.done"))


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


def upload(cache: Path, endpoint: str, prefix: str, types: tuple[str, ...], server: ServerProcess | None = None) -> str:
    """Copy the entry files of `types` under `cache` to `s3://BUCKET/prefix` (concurrent PUTs, or, for more than
    `PUT_LIMIT` files, `server.fill`) and write their index; returns the cache URL."""
    from qie.cache.remote import RemoteBackend, _record

    url = f"s3://{BUCKET}/{prefix}"
    backend = RemoteBackend(url=url, endpoint_url=endpoint, local_dir=cache.parent / "upload-copy")
    backend.check_access(write=True)
    fs = backend.store.fs
    listed = {t: sorted(str(p) for p in (cache / t).glob("*/*.safetensors")) for t in types}
    by_server = server is not None and sum(map(len, listed.values())) > PUT_LIMIT
    if by_server:
        count = server.fill(cache, backend.store.root.split("/", 1)[1], types)
        assert count == sum(map(len, listed.values())), "the server put another number of objects"
    for t in types:
        files = listed[t]
        if not by_server:
            fs.put(files, [f"{backend.store.root}/{Path(f).relative_to(cache).as_posix()}" for f in files])
        for f in files:
            with open(f, "rb") as fh:
                data = fh.read()
            backend.index.add(t, Path(f).name.removesuffix(".safetensors"), _record(data, t))
    backend.flush()
    return url


def overrides(url: str, endpoint: str, local: Path) -> list[str]:
    """Train-stage overrides reading the cache at `url` through a node-local copy in `local` (fresh per run)."""
    return [
        "cache=remote",
        f"cache.backend.url={url}",
        f"cache.backend.endpoint_url={endpoint}",
        f"cache.backend.local_dir={local}",
    ]


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--serve"]:
        serve(int(sys.argv[2]), sys.argv[3])
