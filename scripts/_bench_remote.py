"""The remote backend for the benchmarks: an S3 server on 127.0.0.1 (moto's, in this process), and an ssd cache
folder uploaded into a bucket on it with the index precompute would leave (`scripts/bench_startup.py
--backend remote`). Needs the dev extra (s3fs, moto[server])."""

from __future__ import annotations

import os
import socket
from pathlib import Path

BUCKET = "qie-bench"


def start_server(latency_s: float = 0.0) -> tuple[object, str]:
    """(the server, its endpoint URL), with a bucket `BUCKET`, and test credentials in the environment (which the
    benchmark's child processes inherit). Once `server.latency = latency_s` is set (after filling the bucket),
    the server holds every request that long before it answers: a far-away object store."""
    import logging
    import time

    import s3fs
    from moto.server import ThreadedMotoServer

    class DelayingMotoServer(ThreadedMotoServer):
        latency = 0.0

        def _server_entry(self) -> None:
            from moto.moto_server import threaded_moto_server as served

            make = served.make_server

            def delayed(ip, port, app, *a, **k):
                def slow(environ, start_response):
                    time.sleep(self.latency)
                    return app(environ, start_response)

                return make(ip, port, slow, *a, **k)

            served.make_server = delayed
            try:
                super()._server_entry()
            finally:
                served.make_server = make

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = DelayingMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
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
