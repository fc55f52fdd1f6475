"""Who may ask the studio for what, and which files it serves.

- Every request names a host the studio answers to (`Host`): a page of another site that resolves its name to this
  machine (DNS rebinding) gets nothing. With `studio.token` set, every request carries it too: once as the page's
  `?token=` (then a cookie of this origin), or as `Authorization: Bearer TOKEN`.
- Every request that changes something (a POST) carries the page's secret in `X-Qie-Token`: a random value drawn
  at each start of the server and written into the page (or `studio.token`), and, where the browser says where it
  comes from, this origin (`Origin`, `Sec-Fetch-Site`). Another site's form or script cannot read the secret, and a
  page left open from an earlier start of the server holds a stale one: both change nothing.
- Files are served from inside the run folders of known jobs and the data sets jobs named, after resolving links;
  a `..` or an absolute path outside them is refused.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request

from qie.config.studio import is_loopback

COOKIE = "qie_studio_token"
SECRET_HEADER = "x-qie-token"
STALE = "this page is from an earlier start of the studio (or another site): reload the page"


@dataclass(kw_only=True)
class Guard:
    """The studio's checks of a request, drawn once per start of the server."""

    host: str
    port: int
    token: str | None = None
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24))

    def hosts(self) -> set[str]:
        """The `Host` headers the studio answers to; empty: any (a token guards it)."""
        if self.token:
            return set()
        names = {self.host, "127.0.0.1", "localhost", "[::1]"} if is_loopback(self.host) else {self.host}
        return {f"{name}:{self.port}" for name in names}

    def host_problem(self, request: Request) -> str | None:
        """Why `request`'s Host is not this studio's, or None."""
        allowed = self.hosts()
        host = request.headers.get("host", "")
        if allowed and host not in allowed:
            return f"unknown host {host!r}: open the studio at http://{self.host}:{self.port}/"
        return None

    def token_problem(self, request: Request) -> str | None:
        """Without `studio.token`, None; with it, why the request does not carry it."""
        if not self.token:
            return None
        given = request.cookies.get(COOKIE) or request.query_params.get("token") or ""
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer "):
            given = bearer[7:].strip()
        if hmac.compare_digest(given.encode(), self.token.encode()):
            return None
        return "this studio needs its token: open the address it printed when it started (ending in ?token=...)"

    def write_problem(self, request: Request) -> str | None:
        """Why a request that changes something is refused: not the page's secret (or the token), or sent from
        another origin; None when it may go on."""
        given = request.headers.get(SECRET_HEADER, "").encode()
        valid = [self.secret] + ([self.token] if self.token else [])
        if not any(hmac.compare_digest(given, v.encode()) for v in valid):
            return STALE
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{request.headers.get('host', '')}":
            return f"a request from {origin} changes nothing here"
        if request.headers.get("sec-fetch-site") not in (None, "same-origin", "none"):
            return "a request from another site changes nothing here"
        return None


def inside(root: Path, relative: str) -> Path | None:
    """The file `relative` names inside the folder `root` (links resolved), or None: an absolute path, a `..`, a
    link out of `root`, or no such file."""
    if not relative or relative.startswith(("/", "\\")) or ".." in Path(relative).parts:
        return None
    base = root.resolve()
    path = (base / relative).resolve()
    return path if path.is_relative_to(base) and path.is_file() else None


def within(path: str, roots: list[Path]) -> Path | None:
    """The file at the absolute `path` (links resolved) if it lies inside one of `roots`, else None."""
    if not path or ".." in Path(path).parts:
        return None
    target = Path(path).resolve()
    if not target.is_file():
        return None
    return target if any(target.is_relative_to(root.resolve()) for root in roots) else None


__all__ = ["COOKIE", "SECRET_HEADER", "STALE", "Guard", "inside", "within"]
