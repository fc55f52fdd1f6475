"""The studio's routes (Starlette): the page, the job queue's API, what a job's run folder shows, comparisons, the
data tab and the files they link. Job states change on the event loop only (the queue's one writer); composing a
config runs in a worker thread, one at a time.
"""

from __future__ import annotations

import asyncio
import shlex
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from qie.errors import QieError
from qie.studio import runs
from qie.studio.commands import MODULES, JobRequest, compose, one_line, validate
from qie.studio.forms import stage_form
from qie.studio.guard import COOKIE
from qie.studio.queue import ACTIVE, NewJob
from qie.studio.state import Refused, Studio, job_of, studio_of
from qie.studio.views import data_routes, file_routes, watch_routes

STATIC = Path(__file__).parent / "static"
# How long a stopping server waits for its running jobs to save (Ctrl-C again quits at once).
SHUTDOWN_WAIT_S = 120.0


def build_app(studio: Studio) -> Starlette:
    """The ASGI app of `studio`: its routes behind the guard, the runner started and stopped with it."""

    @asynccontextmanager
    async def lifespan(app: Starlette):
        studio.runner.recover()
        task = asyncio.create_task(studio.runner.run())
        threading.Thread(target=_warm_up, daemon=True).start()
        try:
            yield
        finally:
            task.cancel()
            await studio.runner.shutdown(SHUTDOWN_WAIT_S, studio.force_exit)

    routes = [
        Route("/", page),
        Route("/api/stages", stages),
        Route("/api/form", form),
        Route("/api/check", check, methods=["POST"]),
        Route("/api/jobs", list_jobs),
        Route("/api/jobs", queue_job, methods=["POST"]),
        Route("/api/jobs/{job_id:int}", get_job),
        Route("/api/jobs/{job_id:int}/stop", stop_job, methods=["POST"]),
        Route("/api/jobs/{job_id:int}/resume", resume_job, methods=["POST"]),
        *watch_routes(),
        *data_routes(),
        *file_routes(),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    handlers = {Refused: _refused, QieError: _qie_error, HTTPException: _http_error, Exception: _unexpected}
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(BaseHTTPMiddleware, dispatch=_guarded)],
        exception_handlers=handlers,
    )
    app.state.studio = studio
    return app


async def _guarded(request: Request, call_next: Callable) -> Response:
    """The guard's checks before any route: the host, the token, and for a POST the page's secret and origin."""
    guard = studio_of(request).guard
    if problem := guard.host_problem(request):
        return JSONResponse({"error": problem}, status_code=403)
    if problem := guard.token_problem(request):
        return JSONResponse({"error": problem}, status_code=401)
    if request.method not in ("GET", "HEAD") and (problem := guard.write_problem(request)):
        return JSONResponse({"error": problem}, status_code=403)
    if request.url.path == "/" and "token" in request.query_params:
        # The printed address carries the token: keep it in a cookie of this origin, out of the address bar.
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, guard.token or "", httponly=True, samesite="strict")
        return response
    response = await call_next(request)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("Referrer-Policy", "no-referrer")
    return response


async def page(request: Request) -> HTMLResponse:
    """The page, with this start's secret in it (what the page's requests that change something carry)."""
    studio = studio_of(request)
    html = (STATIC / "index.html").read_text(encoding="utf-8").replace("__QIE_SECRET__", studio.guard.secret)
    return HTMLResponse(html, headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY"})


async def stages(request: Request) -> JSONResponse:
    studio = studio_of(request)
    return JSONResponse(
        {"stages": list(MODULES), "home": str(studio.home), "parallel": studio.settings.parallel, "cwd": studio.cwd}
    )


async def form(request: Request) -> JSONResponse:
    """`?stage=train&o=experiment=demo&o=...`: the stage's form with those overrides; a refusal as `{"error"}`."""
    stage = request.query_params.get("stage", "train")
    if stage not in MODULES:
        raise Refused(400, f"unknown stage {stage!r}: the studio runs qie's own stages: {', '.join(MODULES)}")
    overrides = request.query_params.getlist("o")
    return JSONResponse(await run_in_threadpool(stage_form, stage, overrides))


async def check(request: Request) -> JSONResponse:
    """The command a job would run, after the checks queueing makes (nothing is queued)."""
    studio = studio_of(request)
    job = JobRequest.of(await _body(request))
    await run_in_threadpool(validate, job)
    command = job.command(str(studio.store.runs / f"{_next_id(studio):04d}-{job.stage}"))
    return JSONResponse({"command": command, "command_line": shlex.join(command)})


async def queue_job(request: Request) -> JSONResponse:
    """Queue a job: `{"stage", "overrides", "multirun"}` checked and its config validated as the CLI would."""
    studio = studio_of(request)
    job = JobRequest.of(await _body(request))
    configs = await run_in_threadpool(validate, job)
    new = NewJob(stage=job.stage, overrides=job.overrides, multirun=job.multirun, cwd=studio.cwd)
    queued = studio.store.add(new, job.command)
    for path in _data_paths(configs):
        studio.store.add_dataset(path)
    studio.runner.wake.set()
    return JSONResponse(queued.as_dict(), status_code=201)


async def list_jobs(request: Request) -> JSONResponse:
    """Every job, oldest first; a running one with its progress (step of `train.max_steps`)."""

    def listed() -> list[dict]:
        jobs = [job.as_dict() for job in studio_of(request).store.jobs()]
        for job in jobs:
            if job["state"] in ACTIVE and not job["multirun"] and job["stage"] in runs.TRAINING_STAGES:
                job["progress"] = runs.progress(runs.training_folder(Path(job["run_dir"])))
        return jobs

    return JSONResponse({"jobs": await run_in_threadpool(listed)})


async def get_job(request: Request) -> JSONResponse:
    job = job_of(request)
    return JSONResponse({**job.as_dict(), **runs.outputs(Path(job.run_dir))})


async def stop_job(request: Request) -> JSONResponse:
    """Stop a job: a queued one at once, a running one by SIGTERM (a training saves first)."""
    studio = studio_of(request)
    job = job_of(request)
    if not studio.runner.stop(job):
        raise Refused(409, f"job {job.id} is {job.state}: there is nothing to stop")
    return JSONResponse(studio.store.get(job.id).as_dict())


async def resume_job(request: Request) -> JSONResponse:
    """Queue a stopped or failed job again in its run folder (a training with `train.resume=latest`); the new job."""
    studio = studio_of(request)
    job = job_of(request)
    if job.state not in ("stopped", "failed"):
        raise Refused(409, f"job {job.id} is {job.state}: only a stopped or failed job resumes")
    busy = [j.id for j in studio.store.jobs(["queued", *ACTIVE]) if j.run_dir == job.run_dir]
    if busy:
        raise Refused(409, f"job {busy[0]} already continues this run ({job.run_dir})")
    again = JobRequest(stage=job.stage, overrides=job.overrides, multirun=job.multirun).resumed()
    await run_in_threadpool(validate, again)
    new = NewJob(
        stage=again.stage,
        overrides=again.overrides,
        multirun=again.multirun,
        cwd=job.cwd,
        run_dir=job.run_dir,
        resumed_from=job.id,
    )
    queued = studio.store.add(new, again.command)
    studio.runner.wake.set()
    return JSONResponse(queued.as_dict(), status_code=201)


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise Refused(400, "the request's body must be JSON") from None


def _next_id(studio: Studio) -> int:
    jobs = studio.store.jobs()
    return (jobs[-1].id if jobs else 0) + 1


def _data_paths(configs: list[Any]) -> list[str]:
    """The data sets the composed configs name (`data.path`, `data.regularization.path`) that exist."""
    from omegaconf import OmegaConf

    paths = []
    for cfg in configs:
        for key in ("data.path", "data.regularization.path"):
            value = OmegaConf.select(cfg, key, default=None)
            if value and Path(str(value)).expanduser().exists() and str(value) not in paths:
                paths.append(str(Path(str(value)).expanduser().resolve()))
    return paths


def _warm_up() -> None:
    """Compose a training config once in the background: the first form then answers without waiting for torch,
    diffusers and the model families to import."""
    try:
        compose("train", [])
    except Exception:  # only a warm-up: the first form asked for says what is wrong
        pass


async def _refused(request: Request, e: Refused) -> JSONResponse:
    return JSONResponse({"error": str(e)}, status_code=e.status)


async def _qie_error(request: Request, e: QieError) -> JSONResponse:
    return JSONResponse({"error": one_line(str(e))}, status_code=400)


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    return JSONResponse({"error": str(e.detail)}, status_code=e.status_code)


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    return JSONResponse({"error": f"{type(e).__name__}: {one_line(str(e))}"}, status_code=500)


__all__ = ["build_app"]
