"""Runs the queued jobs as subprocesses, `studio.parallel` at a time, and records how each ended.

A job's output (stdout and stderr) goes to `job.log` in its run folder. It runs in a session of its own, so a Ctrl-C
in the studio's terminal reaches it only through the studio, which stops it as the Stop button does (SIGTERM: a
training saves a checkpoint, then exits 143). On Linux a job is also told to stop (SIGTERM) when the studio dies,
so none outlives it unwatched; a job the studio was running when it died is marked failed, with its last line, when
the studio starts again. Everything here runs on the server's event loop: one writer of the job states.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from qie.studio.queue import ACTIVE, Job, JobStore

LOG = "job.log"
# The line the studio writes into a job's log before each run of it (the command, as a terminal would show it).
HEADER = "qie studio: job "
# Exit statuses of a stage stopped by a signal (128 + SIGTERM / SIGINT; negative: killed before its handler).
# The lines in which a stage says why it ended: its error, or that a signal stopped it (and what it kept).
ERROR_LINES = ("qie: error",)
STOP_LINES = ("qie: stopped", "qie: interrupted")
STOPPED_CODES = (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT)


def _stop_with_parent() -> None:
    """In the child before it runs the command: SIGTERM when the studio's process ends (Linux's parent-death
    signal, kept across exec)."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


if sys.platform.startswith("linux"):
    import ctypes

    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    _PR_SET_PDEATHSIG = 1
    _PREEXEC = _stop_with_parent
else:
    _PREEXEC = None


class Runner:
    """Starts queued jobs while fewer than `parallel` run, reaps those that ended, stops them on request."""

    def __init__(self, store: JobStore, parallel: int) -> None:
        self.store = store
        self.parallel = parallel
        self.processes: dict[int, subprocess.Popen] = {}
        self.wake = asyncio.Event()

    def recover(self) -> None:
        """Mark the jobs a previous server left running as failed, naming their last line (the queued ones wait for
        their turn as before)."""
        for job in self.store.jobs(ACTIVE):
            line = last_line(Path(job.run_dir) / LOG)
            message = f"the studio ended while this job ran; its last line: {line}"
            self.store.move(job.id, ACTIVE, "failed", message=message, ended=time.time(), pid=None)

    async def run(self) -> None:
        """Reap and start jobs until cancelled: every half second, or at once when woken (a job queued)."""
        while True:
            try:
                self.tick()
            except sqlite3.Error as e:  # the queue busy or its disk full: said, and tried again
                print(f"qie: studio: the queue cannot be read or written ({e}); trying again", flush=True)
            try:
                await asyncio.wait_for(self.wake.wait(), timeout=0.5)
            except TimeoutError:
                pass
            self.wake.clear()

    def tick(self) -> None:
        """Record the jobs that ended; start queued ones up to `parallel`."""
        self.tick_ended()
        for job in self.store.jobs(["queued"])[: max(0, self.parallel - len(self.processes))]:
            self.start(job)

    def start(self, job: Job) -> None:
        """Run `job`'s command in its run folder's log; a job that cannot start fails with the reason."""
        folder = Path(job.run_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / LOG, "ab") as log:
                log.write(f"{HEADER}{job.id}: {job.as_dict()['command_line']}\n".encode())
                log.flush()
                process = subprocess.Popen(
                    job.command,
                    cwd=job.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,
                    preexec_fn=_PREEXEC,
                )
        except OSError as e:
            self.store.move(job.id, ["queued"], "failed", message=f"could not start: {e}", ended=time.time())
            return
        self.processes[job.id] = process
        self.store.move(job.id, ["queued"], "running", pid=process.pid, started=time.time())

    def ended(self, job_id: int, code: int) -> None:
        """Record how job `job_id` ended: done (0), stopped (a stop signal's status) or failed, with its last
        line."""
        job = self.store.get(job_id)
        if job is None:
            return
        state = "done" if code == 0 else "stopped" if code in STOPPED_CODES else "failed"
        said = STOP_LINES if state == "stopped" else ERROR_LINES
        message = None if state == "done" else last_line(Path(job.run_dir) / LOG, said)
        self.store.move(job_id, ACTIVE, state, exit_code=code, message=message, ended=time.time(), pid=None)

    def stop(self, job: Job) -> bool:
        """Stop `job`: a queued one is stopped at once; a running one gets SIGTERM (a training saves, then exits);
        a second stop sends SIGTERM again (a training then exits without its stop save). Whether it was running or
        queued."""
        if job.state == "queued":
            message = "stopped before it started"
            return self.store.move(job.id, ["queued"], "stopped", message=message, ended=time.time())
        process = self.processes.get(job.id)
        if job.state not in ACTIVE or process is None:
            return False
        self.store.move(job.id, ACTIVE, "stopping")
        signal_group(process, signal.SIGTERM)
        return True

    async def shutdown(self, wait_s: float, force: Callable[[], bool]) -> None:
        """Stop every running job as `stop` does and wait up to `wait_s` seconds (until `force()` says to quit now)
        for them to save and exit; record how they ended."""
        for job_id, process in list(self.processes.items()):
            self.store.move(job_id, ACTIVE, "stopping")
            signal_group(process, signal.SIGTERM)
        if self.processes:
            names = ", ".join(str(i) for i in self.processes)
            print(f"qie: studio stopping: waiting for job(s) {names} to save (Ctrl-C again quits at once)", flush=True)
        deadline = time.monotonic() + wait_s
        while self.processes and time.monotonic() < deadline and not force():
            self.tick_ended()
            await asyncio.sleep(0.2)
        self.tick_ended()

    def tick_ended(self) -> None:
        """Record the jobs that ended, starting none."""
        for job_id, process in list(self.processes.items()):
            if (code := process.poll()) is not None:
                del self.processes[job_id]
                self.ended(job_id, code)


def signal_group(process: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the job's process group (its own session: the stage and its loader workers, as a terminal's
    Ctrl-C reaches them)."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass  # it ended meanwhile: the next tick records it


def last_line(path: Path, said: tuple[str, ...] = ERROR_LINES, window: int = 16384) -> str:
    """The last line of the log at `path` that says something, preferring one near the end that starts with one of
    `said` (the stage's error or stop line); "(no output)" for an empty or missing log."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - window))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return "(no output)"
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith(HEADER)]
    telling = [line for line in lines[-20:] if line.startswith(said)]
    return (telling or lines or ["(no output)"])[-1]


__all__ = ["LOG", "Runner", "last_line", "signal_group"]
