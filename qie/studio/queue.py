"""The studio's queue: its jobs and the data sets they named, in a SQLite database under `studio.home`.

Every change of a job's state is one conditional UPDATE (`move`): a request and the runner that race for the same
job (a stop against its start, a second stop) cannot both win, and what survives a restart of the server is what
the database says.
"""

from __future__ import annotations

import json
import shlex
import sqlite3
import time
from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path

from qie.errors import StorageError

DATABASE = "queue.sqlite"
STATES = ("queued", "running", "stopping", "stopped", "done", "failed")
ACTIVE = ("running", "stopping")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    stage TEXT NOT NULL,
    overrides TEXT NOT NULL,
    multirun INTEGER NOT NULL,
    command TEXT NOT NULL DEFAULT '[]',
    cwd TEXT NOT NULL,
    run_dir TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL,
    pid INTEGER,
    exit_code INTEGER,
    message TEXT,
    resumed_from INTEGER,
    created REAL NOT NULL,
    started REAL,
    ended REAL
);
CREATE TABLE IF NOT EXISTS datasets (path TEXT PRIMARY KEY, added REAL NOT NULL);
"""
# A job with the id of the job that resumed it (the newest, where it was resumed more than once).
_SELECT = "SELECT *, (SELECT MAX(c.id) FROM jobs c WHERE c.resumed_from = jobs.id) AS continued_by FROM jobs"


@dataclass(kw_only=True)
class Job:
    """One queued command and where it stands."""

    id: int
    stage: str
    overrides: list[str]
    multirun: bool
    command: list[str]  # the argument list the subprocess runs
    cwd: str  # the folder it runs in (relative paths in its overrides are read from there)
    run_dir: str  # its Hydra run folder (a sweep's: the sweep folder)
    state: str
    pid: int | None = None
    exit_code: int | None = None
    message: str | None = None  # why it failed or stopped: its last line
    resumed_from: int | None = None
    continued_by: int | None = None  # the job that resumed this one
    created: float = 0.0
    started: float | None = None
    ended: float | None = None

    def as_dict(self) -> dict:
        """The job as the API gives it, with its command as one shell line (what a terminal would run)."""
        return {**asdict(self), "command_line": shlex.join(self.command)}


@dataclass(kw_only=True)
class NewJob:
    """What a queued job is made of; its run folder and command follow from its id (`JobStore.add`)."""

    stage: str
    overrides: list[str]
    multirun: bool
    cwd: str
    run_dir: str | None = None  # None: a new folder under the studio's runs folder
    resumed_from: int | None = None


class JobStore:
    """The jobs and data sets of one studio home, read and written through short-lived connections."""

    def __init__(self, home: Path) -> None:
        self.path = home / DATABASE
        self.runs = home / "runs"
        try:
            with closing(self._connect()) as db:
                db.executescript(_SCHEMA)
        except sqlite3.Error as e:
            why = f"studio.home: the queue {self.path} cannot be opened ({e}): choose another folder"
            raise StorageError(why) from None

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        db.row_factory = sqlite3.Row
        return db

    def add(self, new: NewJob, command_of: Callable[[str], list[str]]) -> Job:
        """Queue `new`; `command_of(run_dir)` gives its argument list once its folder is known. Returns the job."""
        with closing(self._connect()) as db:
            db.execute("BEGIN IMMEDIATE")
            cursor = db.execute(
                "INSERT INTO jobs (stage, overrides, multirun, cwd, state, resumed_from, created) "
                "VALUES (?, ?, ?, ?, 'queued', ?, ?)",
                (new.stage, json.dumps(new.overrides), int(new.multirun), new.cwd, new.resumed_from, time.time()),
            )
            job_id = int(cursor.lastrowid)
            run_dir = new.run_dir or str(self.runs / f"{job_id:04d}-{new.stage}")
            command = command_of(run_dir)
            db.execute("UPDATE jobs SET run_dir = ?, command = ? WHERE id = ?", (run_dir, json.dumps(command), job_id))
            db.execute("COMMIT")
        return self.get(job_id)

    def get(self, job_id: int) -> Job | None:
        """The job of `job_id`, or None."""
        with closing(self._connect()) as db:
            row = db.execute(f"{_SELECT} WHERE id = ?", (job_id,)).fetchone()
        return _job(row) if row else None

    def jobs(self, states: Iterable[str] = STATES) -> list[Job]:
        """The jobs in `states`, oldest first."""
        wanted = list(states)
        marks = ", ".join("?" * len(wanted))
        with closing(self._connect()) as db:
            rows = db.execute(f"{_SELECT} WHERE state IN ({marks}) ORDER BY id", wanted).fetchall()
        return [_job(row) for row in rows]

    def move(self, job_id: int, before: Iterable[str], after: str, **values: object) -> bool:
        """Set job `job_id` to state `after` (and the columns in `values`) if it is in one of `before`; whether it
        was."""
        sets = ", ".join(["state = ?", *(f"{name} = ?" for name in values)])
        states = list(before)
        marks = ", ".join("?" * len(states))
        with closing(self._connect()) as db:
            cursor = db.execute(
                f"UPDATE jobs SET {sets} WHERE id = ? AND state IN ({marks})",
                [after, *values.values(), job_id, *states],
            )
        return cursor.rowcount == 1

    def add_dataset(self, path: str) -> None:
        """Remember the data set at `path` (a job named it, or the data tab opened it)."""
        with closing(self._connect()) as db:
            db.execute("INSERT OR IGNORE INTO datasets (path, added) VALUES (?, ?)", (path, time.time()))

    def datasets(self) -> list[str]:
        """The data sets remembered, oldest first."""
        with closing(self._connect()) as db:
            return [row["path"] for row in db.execute("SELECT path FROM datasets ORDER BY added").fetchall()]


def _job(row: sqlite3.Row) -> Job:
    values = dict(row)
    values["overrides"] = json.loads(values["overrides"])
    values["command"] = json.loads(values["command"])
    values["multirun"] = bool(values["multirun"])
    return Job(**values)


__all__ = ["ACTIVE", "STATES", "Job", "JobStore", "NewJob"]
