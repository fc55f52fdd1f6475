"""`python -m qie.studio` against a real server on 127.0.0.1 (started and stopped here) and real jobs: refusals
before anything is queued (a bad value in qie's one line, a stage that is not qie's, a command injected into a
setting, Hydra's options, a forged or cross-site request), a tiny training queued, watched, stopped (checkpoint
saved) and resumed to its end, files confined to the run folders, and the queue surviving a crash of the server."""

from __future__ import annotations

import ast
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from studio_helpers import ROOT, TINY_TRAIN, alive, start_studio

pytestmark = pytest.mark.subprocess


@pytest.fixture(scope="module")
def studio(tmp_path_factory: pytest.TempPathFactory, qie_home: Path):
    server = start_studio(tmp_path_factory.mktemp("studio") / "home")
    yield server
    server.stop()


def test_the_entry_point_loads_no_model_library() -> None:
    """The server answers in a second: its modules import no torch, diffusers or transformers (a job's config is
    composed, and they are imported, only when the first job or form is asked for)."""
    modules = ", ".join(f"qie.studio.{m}" for m in ("__main__", "app", "views", "forms", "runs", "datasets", "server"))
    heavy = ("torch", "diffusers", "transformers")
    code = f"import sys, {modules}; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_nothing_outside_the_studio_imports_it() -> None:
    """The studio sits on top of the library: no module of qie outside `qie/studio/` imports it."""
    found = []
    for path in (ROOT / "qie").rglob("*.py"):
        if path.relative_to(ROOT / "qie").parts[0] == "studio":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.name}: {n}" for n in names if n == "qie.studio" or n.startswith("qie.studio.")]
    assert found == []


def test_refusals_change_nothing(studio) -> None:
    cases = {
        "train.max_steps=-3": "train.max_steps=-3 is out of range: it must lie in [0, inf]",
        "train.max_steps=abc": "train.max_steps: Value 'abc' of type 'str' could not be converted to Integer",
        "train.max_steps=1; rm -rf ~": "LexerNoViableAltException: train.max_steps=1; rm -rf ~",
        "model.pretrained_model_name_or_path=$(touch pwned)": "mismatched input '(' expecting <EOF>",
        "--config-dir=/tmp": "'--config-dir=/tmp' is an option, not a setting",
        "hydra.run.dir=/tmp/elsewhere": "hydra.run.dir is not set from the studio",
    }
    for override, message in cases.items():
        answer = studio.post("/api/jobs", {"stage": "train", "overrides": [override]})
        assert answer.status == 400, override
        assert answer.body["error"].startswith(message) and "\n" not in answer.body["error"], answer.body
    answer = studio.post("/api/jobs", {"stage": "os", "overrides": ["system=rm"]})
    assert (answer.status, answer.body["error"]) == (
        400,
        "unknown stage 'os': the studio runs qie's own stages: train, precompute, eval, caption, infer, export, "
        "extract_lora, demo, plan, cache",
    )
    # A sweep is checked value by value: the second learning rate is refused.
    answer = studio.post("/api/jobs", {"stage": "train", "multirun": True, "overrides": ["train.learning_rate=1,-1"]})
    assert answer.body["error"] == "train.learning_rate=-1.0 is out of range: it must lie in [0.0, 3.4e+38]"
    valid = {"stage": "train", "overrides": ["train.max_steps=1"]}
    forged = [
        studio.post("/api/jobs", valid, token=""),  # no secret
        studio.post("/api/jobs", valid, token="guessed"),  # a wrong one
        studio.post("/api/jobs", valid, headers={"Origin": "http://evil.example"}),  # another site's page
        studio.post("/api/jobs", valid, headers={"Sec-Fetch-Site": "cross-site"}),
        studio.post("/api/jobs", valid, headers={"Host": "evil.example"}),  # a name rebound to this machine
    ]
    assert [a.status for a in forged] == [403] * 5, [a.body for a in forged]
    assert studio.request("/api/jobs", headers={"Host": "evil.example"}).status == 403
    assert studio.request("/api/jobs").body["jobs"] == []  # nothing was queued
    checked = studio.post("/api/check", {"stage": "train", "overrides": ["train.max_steps=7"]})
    assert checked.status == 200 and checked.body["command"][1:4] == ["-m", "qie.train", "train.max_steps=7"]
    assert studio.request("/files/run/1/report.html").status == 404
    assert studio.request("/files/data?path=/etc/passwd").status == 404


def test_the_form_is_the_schema(studio) -> None:
    form = studio.request("/api/form?stage=train&o=train/objective=dpo").body
    fields = {f["key"]: f for g in form["groups"] for f in g["fields"]}
    steps = fields["train.max_steps"]
    assert (steps["kind"], steps["value"], steps["min"], steps["max"]) == ("int", 1000, 0, None)
    assert fields["train.mixed_precision"]["choices"] == ["auto", "no", "bf16", "fp16"]
    assert fields["validation.every"]["help"].startswith("Sample the validation inputs every N optimizer steps")
    assert fields["train.objective.beta"]["value"] == 2000.0  # DPO's own setting, from its constructor
    assert [p["value"] for p in form["presets"] if p["group"] == "train/objective"] == ["dpo"]
    evaluation = studio.request("/api/form?stage=eval").body
    fields = {f["key"]: f for g in evaluation["groups"] for f in g["fields"]}
    assert fields["eval.rewards.judge_instruction.question"]["value"] == "instruction"
    assert fields["eval.rewards.judge_instruction.device"]["add"] is True  # not in the yaml: +key
    refused = studio.request("/api/form?stage=train&o=model=nope")
    assert refused.status == 400 and "model" in refused.body["error"] and "nope" in refused.body["error"]


def test_a_job_runs_stops_with_a_checkpoint_and_resumes(studio, tmp_path: Path) -> None:
    injected = f"validation.negative_prompt='$(touch {tmp_path}/a); touch {tmp_path}/b'"
    # Stopped once its first step is logged, it has 9 more to go: the stop lands well before the end even where a
    # step takes a tenth of a second.
    overrides = ["train.max_steps=10", *TINY_TRAIN, injected]
    queued = studio.post("/api/jobs", {"stage": "train", "overrides": overrides})
    assert queued.status == 201 and queued.body["state"] == "queued", queued.body
    job_id, run_dir = queued.body["id"], Path(queued.body["run_dir"])
    assert queued.body["command"][3:] == [*overrides, f"hydra.run.dir={run_dir}"]  # one argument per override
    watched = studio.watch_until(job_id, lambda w: w["all_metrics"])
    assert watched["progress"]["max_steps"] == 10 and watched["all_metrics"][0]["step"] == 1
    assert isinstance(watched["all_metrics"][0]["loss"], float)
    assert studio.post(f"/api/jobs/{job_id}/stop").status == 200
    stopped = studio.wait(job_id, ("stopped", "done", "failed"))
    assert (stopped["state"], stopped["exit_code"]) == ("stopped", 143), stopped
    assert "stopped by signal 15" in stopped["message"]
    assert stopped["checkpoints"] and stopped["checkpoints"][-1] != "step-000010"
    assert studio.post(f"/api/jobs/{job_id}/stop").status == 409  # nothing to stop: nothing changes

    _assert_files_confined(studio, job_id, run_dir)
    resumed = studio.post(f"/api/jobs/{job_id}/resume")
    assert resumed.status == 201 and resumed.body["id"] != job_id and resumed.body["run_dir"] == str(run_dir)
    assert resumed.body["overrides"] == [*overrides, "train.resume=latest"]
    assert studio.post(f"/api/jobs/{job_id}/resume").status == 409  # already continued by the new job
    done = studio.wait(resumed.body["id"], ("done", "failed", "stopped"))
    assert done["state"] == "done", studio.log(done["id"])
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 10
    assert "resumed from" in (run_dir / "job.log").read_text()
    assert done["report"] == "report.html" and studio.request(f"/files/run/{done['id']}/report.html").status == 200
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # the value stayed a value
    assert injected in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())


def _assert_files_confined(studio, job_id: int, run_dir: Path) -> None:
    """A run folder's files are served; nothing outside it, by `..`, an absolute path or a link."""
    report = studio.request(f"/files/run/{job_id}/report.html")
    assert report.status == 200 and "sandbox" in report.headers["content-security-policy"]
    (run_dir / "outside").symlink_to("/etc/hostname")
    refused = [
        f"/files/run/{job_id}/%2E%2E/%2E%2E/queue.sqlite",
        f"/files/run/{job_id}/..%2F..%2Fqueue.sqlite",
        f"/files/run/{job_id}/%2Fetc%2Fhostname",
        f"/files/run/{job_id}/outside",
        "/files/data?path=/etc/hostname",
        f"/files/data?path={run_dir}/report.html",
    ]
    assert [studio.request(path).status for path in refused] == [404] * len(refused)
    demo = next(Path(os.environ["QIE_HOME"], "demo_data").glob("edit-*/training_images/*.png"))
    thumb = studio.request(f"/files/data?path={demo}&thumb=1")
    assert thumb.status == 200 and thumb.headers["content-type"] == "image/png"


def test_the_queue_survives_a_crash_of_the_server(tmp_path: Path, qie_home: Path) -> None:
    home = tmp_path / "home"
    first = start_studio(home)
    try:
        long = {"stage": "train", "overrides": ["train.max_steps=1000", *TINY_TRAIN]}
        running, waiting = (first.post("/api/jobs", long).body["id"] for _ in range(2))
        pid = first.wait(running, ("running",))["pid"]
        assert first.job(waiting)["state"] == "queued"
    finally:
        first.stop(signal.SIGKILL)  # a crash: no shutdown of its own
    deadline = time.monotonic() + 60
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid)  # told to stop when the server died: no training left unwatched
    second = start_studio(home)
    try:
        lost = second.job(running)
        lines = (Path(lost["run_dir"]) / "job.log").read_text().splitlines()
        said = [line for line in lines if line.strip() and not line.startswith("qie studio: job")]
        last = (said or ["(no output)"])[-1]
        assert lost["state"] == "failed"
        assert lost["message"] == f"the studio ended while this job ran; its last line: {last.strip()}"
        assert second.wait(waiting, ("running",))["state"] == "running"  # the queue went on
        stale = second.post(f"/api/jobs/{waiting}/stop", token=first.secret)  # a page of the first server
        assert stale.status == 403 and "earlier start of the studio" in stale.body["error"]
        assert second.job(waiting)["state"] == "running"
    finally:
        assert second.stop() == 0  # Ctrl-C: its running job is stopped and waited for
    third = start_studio(home)
    try:
        states = {job["id"]: job["state"] for job in third.request("/api/jobs").body["jobs"]}
        assert states == {running: "failed", waiting: "stopped"}
    finally:
        third.stop()


def test_a_token_guards_every_request(tmp_path: Path, qie_home: Path) -> None:
    server = start_studio(tmp_path / "home", "studio.token=s3cret")
    try:
        printed = f"/?token=s3cret (queue and runs in {tmp_path / 'home'}; Ctrl-C stops it)"
        assert server.lines[0].endswith(printed)
        assert server.request("/").status == 401 and server.request("/api/jobs").status == 401
        assert server.request("/api/jobs", headers={"Authorization": "Bearer guessed"}).status == 401
        assert server.request("/api/jobs", headers={"Authorization": "Bearer s3cret"}).body == {"jobs": []}
        host, port = server.base.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("GET", "/?token=s3cret")  # the printed address: the token kept in a cookie of the origin
        opened = connection.getresponse()
        assert opened.status == 303 and opened.getheader("location") == "/"
        assert opened.getheader("set-cookie").startswith("qie_studio_token=s3cret;")
        page = server.request("/", headers={"Cookie": "qie_studio_token=s3cret"})
        assert page.status == 200 and 'name="qie-secret"' in page.body
        bearer = {"Authorization": "Bearer s3cret"}
        refused = server.post("/api/jobs", {"stage": "os"}, headers=bearer, token="s3cret")
        assert refused.status == 400 and refused.body["error"].startswith("unknown stage 'os'")
        assert server.post("/api/jobs", {"stage": "os"}, headers=bearer, token="").status == 403
    finally:
        server.stop()


def test_settings_refused_in_one_line(tmp_path: Path) -> None:
    def studio(*settings: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "qie.studio", f"studio.home={tmp_path}", *settings]
        return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)

    exposed = studio("studio.host=0.0.0.0")
    assert exposed.returncode == 2
    assert exposed.stderr.strip() == (
        "qie: error: studio.host=0.0.0.0 serves the page beyond this machine: set studio.token=SECRET too (every "
        "request must then carry it), or keep studio.host=127.0.0.1"
    )
    assert studio("studio.parallel=0").stderr.strip() == (
        "qie: error: studio.parallel=0 is out of range: it must lie in [1, inf]"
    )


def test_the_wheel_holds_the_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file of `qie/studio/static/` is package data (setup.cfg), so an installed qie serves the whole page."""
    from setuptools import distutils  # setuptools' own distutils, whose run_setup builds its Distribution

    monkeypatch.chdir(ROOT)
    dist = distutils.core.run_setup(str(ROOT / "setup.py"), stop_after="config")
    build_py = dist.get_command_obj("build_py")
    build_py.ensure_finalized()
    build_py.manifest_files = {}  # the patterns alone, as without a version-control file finder
    shipped = {Path(f).resolve() for f in build_py.find_data_files("qie", str(ROOT / "qie"))}
    static = {p.resolve() for p in (ROOT / "qie" / "studio" / "static").iterdir()}
    assert static and static <= shipped, sorted(map(str, static - shipped))
