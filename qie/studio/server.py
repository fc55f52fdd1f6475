"""Serving the studio: its home folder and queue opened, the socket bound (a busy port said in one line), the
address printed, and uvicorn run until Ctrl-C (which stops the running jobs as the Stop button does, and waits for
them to save)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from qie.config.studio import StudioConfig
from qie.errors import ConfigError, check_writable
from qie.studio.guard import Guard
from qie.studio.queue import JobStore
from qie.studio.runner import Runner
from qie.studio.state import Studio


def open_studio(settings: StudioConfig, port: int) -> Studio:
    """The studio of `settings` on `port`: its home folder made, its queue opened.

    Raises:
        StorageError: `studio.home` cannot be written.
    """
    home = Path(settings.home).expanduser().resolve()
    check_writable(home, "studio.home")
    store = JobStore(home)
    guard = Guard(host=settings.host, port=port, token=settings.token)
    runner = Runner(store, settings.parallel)
    return Studio(settings=settings, home=home, store=store, runner=runner, guard=guard, cwd=os.getcwd())


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (0: any free port).

    Raises:
        ConfigError: the address cannot be bound (a port in use, a host that is not this machine's).
    """
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as e:
        sock.close()
        raise ConfigError(
            f"studio.host={host} studio.port={port} cannot be bound ({e.strerror}): choose another port "
            "(studio.port=0 takes any free one)"
        ) from None
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def serve(settings: StudioConfig) -> None:
    """Serve the studio of `settings` until stopped.

    Raises:
        QieError: the home folder or the address cannot be used (one line).
    """
    import uvicorn

    from qie.studio.app import build_app

    sock = bind(settings.host, settings.port)
    port = sock.getsockname()[1]
    studio = open_studio(settings, port)
    server = uvicorn.Server(uvicorn.Config(build_app(studio), log_level="warning", lifespan="on"))
    studio.force_exit = lambda: server.force_exit
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"http://{host}:{port}/" + (f"?token={settings.token}" if settings.token else "")
    print(f"qie: studio at {address} (queue and runs in {studio.home}; Ctrl-C stops it)", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn raises the Ctrl-C again once it has shut down (its jobs stopped and recorded)
    print(f"qie: studio stopped; its queue and runs are kept in {studio.home}", flush=True)


__all__ = ["bind", "open_studio", "serve"]
