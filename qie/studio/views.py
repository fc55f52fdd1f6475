"""The studio's routes that read: a job's run folder as it runs (polled), several runs compared, the data tab, and
the files they link (confined to the run folders of known jobs and the data sets the jobs named)."""

from __future__ import annotations

import re
from pathlib import Path

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from qie.errors import QieError
from qie.reporting.run_files import METRICS
from qie.studio import runs
from qie.studio.datasets import Page, browse, folder_of, thumbnail
from qie.studio.guard import inside, within
from qie.studio.queue import Job
from qie.studio.runner import LOG
from qie.studio.state import Refused, job_of, studio_of

_MEMBER = re.compile(r"^\d+$")
# Files served from run folders and data sets are shown, never run as this page: a report's own script runs in a
# sandbox of no origin (it cannot call the studio's API with the page's cookie).
_SANDBOX = {"Content-Security-Policy": "sandbox allow-scripts", "Cache-Control": "no-cache"}


def watch_routes() -> list[Route]:
    return [Route("/api/jobs/{job_id:int}/watch", watch), Route("/api/compare", compare)]


def data_routes() -> list[Route]:
    return [
        Route("/api/datasets", list_datasets),
        Route("/api/datasets", add_dataset, methods=["POST"]),
        Route("/api/data", data),
    ]


def file_routes() -> list[Route]:
    return [Route("/files/run/{job_id:int}/{path:path}", run_file), Route("/files/data", data_file)]


async def watch(request: Request) -> JSONResponse:
    """`?offset=N[&member=K]`: the job (or its sweep member K) as it stands: metrics lines after byte N, progress,
    pictures, log tail, outputs, a sweep's members, an evaluation's table."""
    job = job_of(request)
    run_dir = Path(job.run_dir)
    member = request.query_params.get("member", "")
    if member and not _MEMBER.match(member):
        raise Refused(400, f"member {member!r} is no sweep job number")
    folder = run_dir / member if member else run_dir
    offset = _int(request.query_params.get("offset"), 0)
    return JSONResponse(await run_in_threadpool(_watched, job, folder, offset))


def _watched(job: Job, folder: Path, offset: int) -> dict:
    """What `watch` answers, read from the files (in a worker thread)."""
    run_dir = Path(job.run_dir)
    train = runs.training_folder(folder)
    rows, offset, reset = runs.new_rows(train / METRICS, offset)
    where = str(train.relative_to(run_dir)) if train != run_dir else ""
    pictures = runs.latest_pictures(train)
    for shown in pictures.values():
        shown["files"] = [f"{where}/{f}" if where else f for f in shown["files"]]
    outputs = runs.outputs(folder)
    prefix = str(folder.relative_to(run_dir)) if folder != run_dir else ""
    if outputs["report"] and prefix:
        outputs["report"] = f"{prefix}/{outputs['report']}"
    result = {
        "job": job.as_dict(),
        "metrics": rows,
        "offset": offset,
        "reset": reset,
        "measures": runs.measures(train),
        "progress": runs.progress(train) if job.stage in runs.TRAINING_STAGES else {"step": 0, "max_steps": None},
        "pictures": pictures,
        "log": runs.log_tail(run_dir / LOG),
        "outputs": outputs,
        "members": runs.members(run_dir) if job.multirun and folder == run_dir else [],
        "evaluation": runs.evaluation(folder) if job.stage == "eval" else None,
    }
    return result


async def compare(request: Request) -> JSONResponse:
    """`?ids=1,2,4/0`: each run's curves and LoRA (a job, or `job/member` of a sweep), the settings in which they
    differ, and an evaluation of their LoRAs to queue (`qie.eval` with the first job's model, data and preset
    overrides)."""
    studio = studio_of(request)
    picked = []
    for name in (n.strip() for n in request.query_params.get("ids", "").split(",") if n.strip()):
        job_id, _, member = name.partition("/")
        job = studio.store.get(_int(job_id, -1))
        if job is not None and (not member or _MEMBER.match(member)):
            picked.append((name, job, Path(job.run_dir) / member))
    if not picked:
        raise Refused(400, "pick the jobs to compare: ?ids=1,2")
    folders = [folder for _, _, folder in picked]

    def read() -> dict:
        shown = [
            {"id": name, "stage": job.stage, "curves": runs.curves(folder), "lora": runs.outputs(folder)["lora"]}
            for name, job, folder in picked
        ]
        jobs = [job for _, job, _ in picked]
        return {"jobs": shown, "differences": runs.differences(folders), "eval": _eval_overrides(jobs, shown)}

    return JSONResponse(await run_in_threadpool(read))


def _eval_overrides(jobs: list, shown: list[dict]) -> list[str]:
    """The overrides of an evaluation of the compared runs' LoRAs beside the base model: the first run's model,
    experiment and data settings, and `eval.loras`."""
    from qie.studio.commands import quoted

    kept = [o for o in jobs[0].overrides if o.split("=", 1)[0].split(".")[0].lstrip("+") in ("model", "experiment")]
    kept += [o for o in jobs[0].overrides if o.startswith(("data.path=", "cache.dir="))]
    loras = [quoted(s["lora"]) for s in shown if s["lora"]]
    return [*kept, f"eval.loras=[none,{','.join(loras)}]"]


async def list_datasets(request: Request) -> JSONResponse:
    """The data sets the jobs named or the data tab added, and the built-in demo data sets written so far."""
    studio = studio_of(request)
    builtin = sorted(str(p) for p in _builtin_root().glob("*") if p.is_dir() and not p.name.startswith("."))
    return JSONResponse({"datasets": [*studio.store.datasets(), *builtin]})


async def add_dataset(request: Request) -> JSONResponse:
    """`{"path": ...}`: remember a data set for the data tab, once qie's data code reads it."""
    studio = studio_of(request)
    body = await request.json()
    path = str(body.get("path", "")).strip() if isinstance(body, dict) else ""
    if not path:
        raise Refused(400, 'give the data set\'s path: {"path": "/data/my_edits"}')
    resolved = str(Path(path).expanduser().resolve()) if Path(path).expanduser().exists() else path
    await run_in_threadpool(browse, Page(path=resolved, limit=0), studio.home / "images")
    studio.store.add_dataset(resolved)
    return JSONResponse({"datasets": studio.store.datasets()}, status_code=201)


async def data(request: Request) -> JSONResponse:
    """`?path=...&offset=0&limit=48`: samples of a data set a job named (or the data tab added)."""
    studio = studio_of(request)
    path = request.query_params.get("path", "")
    if path not in studio.store.datasets() and not _in_builtin(path):
        raise Refused(403, f"{path!r} is not a data set of this studio: add it in the data tab first")
    query = request.query_params
    page = Page(path=path, offset=_int(query.get("offset"), 0), limit=_int(query.get("limit"), 48))
    try:
        return JSONResponse(await run_in_threadpool(browse, page, studio.home / "images"))
    except QieError as e:
        raise Refused(400, str(e)) from None


async def run_file(request: Request) -> Response:
    """A file inside a known job's run folder (`report.html`, a validation picture, `eval.png`, ...)."""
    job = job_of(request)
    path = inside(Path(job.run_dir), request.path_params["path"])
    if path is None:
        raise Refused(404, "no such file in this job's run folder")
    return FileResponse(path, headers=_SANDBOX)


async def data_file(request: Request) -> Response:
    """`?path=/abs/image.png[&thumb=1]`: an image of a known data set (or a thumbnail of it)."""
    studio = studio_of(request)
    roots = [_builtin_root(), studio.home / "images"]
    roots += [folder_of(p) for p in studio.store.datasets()]
    path = await run_in_threadpool(within, request.query_params.get("path", ""), roots)
    if path is None:
        raise Refused(404, "no such file in the data sets of this studio")
    if request.query_params.get("thumb"):
        try:
            body, media = await run_in_threadpool(thumbnail, path)
        except QieError as e:  # the image module's ImageError, naming the file
            raise Refused(400, str(e)) from None
        return Response(body, media_type=media, headers=_SANDBOX)
    return FileResponse(path, headers=_SANDBOX)


def _builtin_root() -> Path:
    from qie.config import qie_home

    return qie_home() / "demo_data"


def _in_builtin(path: str) -> bool:
    return bool(path) and Path(path).resolve().is_relative_to(_builtin_root().resolve())


def _int(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


__all__ = ["data_routes", "file_routes", "watch_routes"]
