"""What the studio's routes share (`Studio`), how a route refuses a request (`Refused`), and finding a job."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import Request

from qie.config.studio import StudioConfig
from qie.studio.guard import Guard
from qie.studio.queue import Job, JobStore
from qie.studio.runner import Runner


@dataclass(kw_only=True)
class Studio:
    """The settings, the queue, the runner and the request checks of one start of the server."""

    settings: StudioConfig
    home: Path
    store: JobStore
    runner: Runner
    guard: Guard
    cwd: str  # where the jobs run: the server's working folder, as a terminal's command would
    force_exit: Callable[[], bool] = lambda: False  # the server was told to quit at once (a second Ctrl-C)


class Refused(Exception):
    """A request the studio answers with `status` and one line, changing nothing."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def studio_of(request: Request) -> Studio:
    """The studio serving `request`."""
    return request.app.state.studio


def job_of(request: Request) -> Job:
    """The job the path's `job_id` names.

    Raises:
        Refused: 404, no such job.
    """
    job = studio_of(request).store.get(request.path_params["job_id"])
    if job is None:
        raise Refused(404, f"no job {request.path_params['job_id']}")
    return job


__all__ = ["Refused", "Studio", "job_of", "studio_of"]
