"""A real `python -m qie.studio` on 127.0.0.1 (any free port), started and stopped by a test, and a small client of
its API (urllib: what a script without a browser would use)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# A training of the tiny model on the built-in demo data that needs no cache (encoded as it trains): the fastest
# real job. `train.checkpoint_every` above its steps: only the stop save and the end write checkpoints.
TINY_TRAIN = ["cache.mode=live", "train.checkpoint_every=1000"]


@dataclass
class Answer:
    status: int
    body: dict | str
    headers: dict = field(default_factory=dict)


@dataclass
class Studio:
    """A studio server process and what a client needs to talk to it."""

    process: subprocess.Popen
    base: str
    lines: list[str]
    secret: str = ""

    def request(self, path: str, body: object = None, headers: dict | None = None, token: str | None = None) -> Answer:
        """GET `path`, or POST `body` as JSON with the page's secret (`token` instead where given)."""
        data = None if body is None else json.dumps(body).encode()
        sent = dict(headers or {})
        if body is not None:
            sent.setdefault("Content-Type", "application/json")
            sent.setdefault("X-Qie-Token", self.secret if token is None else token)
        req = urllib.request.Request(self.base + path, data=data, headers=sent, method="POST" if data else "GET")
        try:
            with urllib.request.urlopen(req, timeout=120) as response:
                return _answer(response.status, response.read(), dict(response.headers))
        except urllib.error.HTTPError as e:
            return _answer(e.code, e.read(), dict(e.headers))

    def post(self, path: str, body: object = None, **kwargs) -> Answer:
        return self.request(path, {} if body is None else body, **kwargs)

    def job(self, job_id: int) -> dict:
        return self.request(f"/api/jobs/{job_id}").body

    def wait(self, job_id: int, states: tuple[str, ...], timeout: float = 240) -> dict:
        """The job once it is in one of `states`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["state"] in states:
                return job
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} is still {job['state']} after {timeout} s: {self.log(job_id)}")

    def watch_until(self, job_id: int, ready, timeout: float = 240) -> dict:
        """The job's watch answer once `ready(answer)` holds (metrics gathered over the polls)."""
        deadline, offset, rows = time.monotonic() + timeout, 0, []
        while time.monotonic() < deadline:
            answer = self.request(f"/api/jobs/{job_id}/watch?offset={offset}").body
            rows += answer["metrics"]
            offset = answer["offset"]
            answer["all_metrics"] = rows
            if ready(answer):
                return answer
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} did not get there in {timeout} s: {self.log(job_id)}")

    def log(self, job_id: int) -> str:
        job = self.job(job_id)
        return "\n".join(self.request(f"/api/jobs/{job_id}/watch").body["log"][-15:]) + f"\n{job}"

    def stop(self, sig: int = signal.SIGINT, timeout: float = 120) -> int:
        """Stop the server (Ctrl-C: it stops its running jobs and waits for them); its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout)


def _answer(status: int, raw: bytes, headers: dict) -> Answer:
    try:
        return Answer(status, json.loads(raw), headers)
    except ValueError:
        return Answer(status, raw.decode("utf-8", errors="replace"), headers)


def start_studio(home: Path, *settings: str, cwd: Path | None = None) -> Studio:
    """`python -m qie.studio studio.port=0 studio.home=HOME SETTINGS...`, once it answers; its page's secret read."""
    command = [sys.executable, "-m", "qie.studio", "studio.port=0", f"studio.home={home}", *settings]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, cwd=cwd or home.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if "qie: studio at" in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    if not found.wait(60):
        process.kill()
        raise AssertionError("the studio did not start:\n" + "\n".join(lines))
    printed = next(line for line in lines if "qie: studio at" in line)
    address = re.search(r"qie: studio at (http://[^/ ]+)", printed).group(1)
    studio = Studio(process, address, lines)
    page = studio.request("/").body
    match = re.search(r'name="qie-secret" content="([^"]+)"', page) if isinstance(page, str) else None
    studio.secret = match.group(1) if match else ""
    return studio


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
