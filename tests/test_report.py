"""A run's report.html and a sweep's sweep_report.html: written by a tiny training (rewritten at its checkpoint),
rebuilt from the folder, self-contained, and rendered by a real headless Chromium where one is installed."""

from __future__ import annotations

import base64
import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from xml.etree import ElementTree

import pytest
from helpers import CachedData, small_config
from omegaconf import OmegaConf
from PIL import Image

from qie.stages import train as train_stage

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
SECTIONS = (
    "training",
    "step-time-and-memory",
    "held-out-and-validation-measures",
    "validation-pictures",
    "command",
    "config",
    "environment",
)
IMAGE = re.compile(r'<img src="data:image/(png|jpeg|svg\+xml);base64,([A-Za-z0-9+/=]+)" alt="([^"]*)"')


@pytest.fixture(scope="module")
def reported_run(cached_data: CachedData, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A 4-step run with a checkpoint at step 2, validation at 2 and 4 and two held-out samples; the report as it
    stood after the checkpoint of step 2 (read at step 3) and at the end."""
    run_dir = tmp_path_factory.mktemp("reported_run")
    overrides = [
        "train.max_steps=4",
        "train.checkpoint_every=2",
        "validation.every=2",
        "validation.num_inference_steps=2",
        "validation.heldout_samples=2",
        "logging.log_images_count=2",
    ]
    seen = {}

    def at_step(info) -> None:
        if info.step == 3:
            seen["after_checkpoint"] = (run_dir / "report.html").read_text(encoding="utf-8")

    cfg = small_config("train", *cached_data.overrides, *overrides)
    result = train_stage.run(cfg, run_dir, on_step_end=at_step)
    return {"dir": run_dir, "cfg": cfg, "result": result, "mid": seen["after_checkpoint"]}


def images(text: str) -> list[tuple[str, Any]]:
    """(alt text, decoded picture) of each inline <img> of a page: a PIL image, or a chart's parsed SVG (its
    `.size` read from its root's width and height)."""
    return [(alt, _decoded(kind, base64.b64decode(data))) for kind, data, alt in IMAGE.findall(text)]


def _decoded(kind: str, data: bytes) -> Any:
    if kind != "svg+xml":
        return Image.open(io.BytesIO(data))
    root = ElementTree.fromstring(data)  # well-formed, or this raises
    return SimpleNamespace(size=(int(root.attrib["width"]), int(root.attrib["height"])), svg=root)


def test_the_report_holds_its_sections_and_inline_pictures(reported_run: dict) -> None:
    text = (reported_run["dir"] / "report.html").read_text(encoding="utf-8")
    for anchor in SECTIONS:
        assert f'<section id="{anchor}">' in text
    assert "finished at step 4" in text and "step-000002, step-000004" in text
    found = images(text)
    assert text.count("<img") == len(found)  # every picture inline, none by address
    assert not re.search(r'(src|href)="(https?:|//|file:)', text) and "<link" not in text
    alts = [alt for alt, _ in found]
    for chart in ("loss", "learning rate", "gradient norm", "step time", "memory", "heldout/loss"):
        assert chart in alts
    assert {"validation psnr_keep", "validation ssim_edit"} <= set(alts)
    assert all(image.size == (640, 300) for alt, image in found if alt in ("loss", "learning rate"))
    # The validation strips: two samples, each at steps 2 and 4, the pictures the run saved.
    strip = [(alt, image) for alt, image in found if alt.endswith(("step 2", "step 4"))]
    assert len(strip) == 4 and all(image.size == (64, 64) for _, image in strip)
    first = sorted((reported_run["dir"] / "validation" / "step-000004").glob("*.png"))[0]
    assert f"{first.stem} step 4" in [alt for alt, _ in strip]


def test_the_report_is_rewritten_at_each_checkpoint(reported_run: dict) -> None:
    mid = reported_run["mid"]
    assert "in progress: step 2 of 4" in mid and "step-000002" in mid and "step-000004" not in mid
    assert len([alt for alt, _ in images(mid) if alt.endswith("step 2")]) == 2
    assert not [alt for alt, _ in images(mid) if alt.endswith("step 4")]


def test_the_command_and_config_of_the_report_compose_the_run_again(reported_run: dict) -> None:
    from qie.checks import compose

    info = json.loads((reported_run["dir"] / "run_info.json").read_text())
    command = shlex.split(info["command"])
    assert command[:3] == ["python", "-m", "qie.train"]
    again = OmegaConf.to_container(compose("train", command[3:]), resolve=True)
    assert again == OmegaConf.to_container(reported_run["cfg"], resolve=True) == info["config"]
    env = info["environment"]
    assert env["device"] == "cpu" and env["processes"] == 1 and env["versions"]["torch"].startswith("2.")
    text = (reported_run["dir"] / "report.html").read_text(encoding="utf-8")
    assert "python -m qie.train" in text and "max_steps: 4" in text and env["versions"]["diffusers"] in text


def test_the_report_is_rebuilt_from_the_finished_folder(reported_run: dict, tmp_path: Path, capsys) -> None:
    from qie import report

    copy = shutil.copytree(reported_run["dir"], tmp_path / "run")
    (copy / "report.html").unlink()
    report.main([str(copy)])
    rebuilt = (copy / "report.html").read_text(encoding="utf-8")
    assert capsys.readouterr().out == f"qie: report {copy / 'report.html'}\n"
    assert [alt for alt, _ in images(rebuilt)] == [
        alt for alt, _ in images((reported_run["dir"] / "report.html").read_text())
    ]
    with pytest.raises(SystemExit) as end:
        report.main([str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert end.value.code == 2 and err.startswith("qie: error: ") and err.count("\n") == 1 and "nowhere" in err
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep_summary.json").write_text('{"jobs": 3}')
    with pytest.raises(SystemExit) as end:
        report.main([str(tmp_path / "sweep")])
    err = capsys.readouterr().err
    assert end.value.code == 2 and err.count("\n") == 1 and "sweep_summary.json is not a sweep summary" in err
    assert not (tmp_path / "sweep" / "sweep_report.html").exists()


def _job(sweep: Path, name: str, lr: str, losses: list[float], heldout: float, source: Path) -> dict:
    """A sweep job's folder: its overrides, metrics, result and the last validation pictures of `source`."""
    folder = sweep / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text(json.dumps(["model=tiny", f"train.learning_rate={lr}"]))
    lines = [json.dumps({"step": n + 1, "loss": loss}) for n, loss in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    result = {"step": len(losses), "loss": losses[-1], "heldout_loss": heldout, "stopped_by_signal": False}
    (folder / "train_result.json").write_text(json.dumps(result))
    shutil.copytree(source / "validation" / "step-000004", folder / "validation" / "step-000004")
    return folder


def _sweep(sweep: Path, source: Path) -> Path:
    """A sweep of three jobs over the learning rate, summarised; its report."""
    from qie.reporting.sweep_summary import write_summary

    folders = [
        _job(sweep, str(n), lr, [1.0, 0.9 - n / 10], 0.8 - n / 10, source)
        for n, lr in enumerate(["1e-4", "3e-4", "1e-3"])
    ]
    write_summary(sweep, folders)
    return sweep / "sweep_report.html"


def test_a_sweep_writes_its_report_beside_its_summary(reported_run: dict, tmp_path: Path) -> None:
    text = _sweep(tmp_path, reported_run["dir"]).read_text(encoding="utf-8")
    assert (tmp_path / "sweep_summary.md").is_file()
    alts = [alt for alt, _ in images(text)]
    assert "loss of every job" in alts and "held-out loss against train.learning_rate" in alts
    assert "<td>train.learning_rate=3e-4</td>" in text and "0.6 (best)" in text
    pictures = [alt for alt in alts if alt.startswith("job ")]
    assert len(pictures) == 3 * 2 and "job 2 (step 4)" in pictures[-1]


def _chromium(page: Path, tmp_path: Path, *what: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--enable-logging=stderr",  # the page's console (a script error among it) on stderr
        "--v=0",
    ]
    return subprocess.run([CHROMIUM, *flags, *what, page.as_uri()], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium installed (apt install chromium)")
def test_chromium_renders_the_reports_with_every_picture(reported_run: dict, tmp_path: Path) -> None:
    page = reported_run["dir"] / "report.html"
    for shown in (page, _sweep(tmp_path / "sweep", reported_run["dir"])):
        dom = _chromium(shown, tmp_path, "--dump-dom")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert [line for line in dom.stderr.splitlines() if ":CONSOLE" in line] == []  # no script error, no message
        count = shown.read_text(encoding="utf-8").count("<img")
        body = re.search(r"<body([^>]*)>", dom.stdout).group(1)
        assert count > 5 and f'data-images-ok="{count}"' in body and 'data-images-failed="0"' in body, body
    shot = tmp_path / "report.png"
    done = _chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1400,2400")
    assert done.returncode == 0 and Image.open(shot).size == (1400, 2400), done.stderr[-2000:]


def test_a_report_that_cannot_be_written_is_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from qie.stages.train_report import refresh_report

    (tmp_path / "report.html").mkdir()  # where the page would go: a folder, not a file
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')  # a torn last line
    assert refresh_report(tmp_path, SimpleNamespace(is_main_process=True)) is None
    assert "the report of" in caplog.text and "report.html is a folder" in caplog.text
    (tmp_path / "report.html").rmdir()
    assert refresh_report(tmp_path, SimpleNamespace(is_main_process=True)) == tmp_path / "report.html"
    assert "in progress: step 1" in (tmp_path / "report.html").read_text()
    assert refresh_report(tmp_path, SimpleNamespace(is_main_process=False)) is None


def test_long_curves_are_thinned_to_what_a_chart_shows() -> None:
    from qie.reporting.charts import MAX_POINTS, _finite

    xs, ys = _finite(list(range(1, 10_002)), [float(x) for x in range(1, 10_002)])
    assert len(xs) <= MAX_POINTS + 1 and xs[0] == 1 and xs[-1] == 10_001 and xs == ys


@pytest.mark.subprocess
def test_a_report_is_written_without_a_plotting_library(reported_run: dict) -> None:
    """The train stage rewrites the report at each checkpoint and at the end, in the training process: its charts
    are written as SVG text, so no plotting library adds its memory and import time to the run's end."""
    code = (
        "import sys; from pathlib import Path; import qie.stages.train; "
        "from qie.reporting.run_report import write_report; "
        f"write_report(Path({str(reported_run['dir'])!r})); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'matplotlib', 'plotly', 'seaborn'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    charts = [image for alt, image in images((reported_run["dir"] / "report.html").read_text()) if alt == "loss"]
    assert len(charts) == 1 and charts[0].size == (640, 300)
    lines = charts[0].svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 1 and len(lines[0].attrib["points"].split()) == 4  # the 4 steps' losses


def test_the_rebuilt_command_composes_the_same_config() -> None:
    """Outside the Hydra CLI the overrides are rebuilt from the config: odd values quoted, another stage's own
    section (the demo's, in the config its training runs with) left out."""
    from qie.checks import compose
    from qie.checks.command import rebuilt_overrides
    from qie.config import for_stage

    odd = [
        "model=tiny_plus",
        "data.path='/data/my \\'set\\''",
        "train.learning_rate=3e-4",
        "validation.step_counts=[2,4]",
    ]
    cfg = compose("train", odd + ["logging.report_to=none"])
    overrides = rebuilt_overrides(OmegaConf.to_container(cfg, resolve=True), "train")
    assert overrides[0] == "model=tiny_plus" and "train.learning_rate=0.0003" in overrides
    assert OmegaConf.to_container(compose("train", overrides), resolve=True) == OmegaConf.to_container(
        cfg, resolve=True
    )
    demo = compose("demo", ["demo.train_samples=3", "train.max_steps=7"])
    overrides = rebuilt_overrides(OmegaConf.to_container(demo, resolve=True), "train")
    assert not [o for o in overrides if "demo." in o] and "train.max_steps=7" in overrides
    again = OmegaConf.to_container(compose("train", overrides), resolve=True)
    assert again == OmegaConf.to_container(for_stage(demo, "train"), resolve=True)


def test_a_long_runs_strips_show_a_spread_of_steps_and_the_first_pictures(tmp_path: Path) -> None:
    from qie.reporting.run_report import MAX_STRIP_ROWS, MAX_STRIP_STEPS, write_report

    for step in range(10, 210, 10):  # 20 validation steps of 20 pictures each
        folder = tmp_path / "validation" / f"step-{step:06d}"
        folder.mkdir(parents=True)
        for n in range(20):
            Image.new("RGB", (8, 8), (n, step, 0)).save(folder / f"{n:02d}.png")
    (tmp_path / "validation" / "step-000200" / "00.png").write_bytes(b"not a picture")
    Image.new("RGBA", (8, 8), (0, 0, 0, 0)).save(tmp_path / "validation" / "step-000200" / "01.png")
    text = write_report(tmp_path).read_text(encoding="utf-8")
    alts = [alt for alt, _ in images(text)]
    assert "00.png: unreadable" in text and len(alts) == MAX_STRIP_ROWS * MAX_STRIP_STEPS - 1 == 16 * 12 - 1
    kinds = {alt: kind for kind, _, alt in IMAGE.findall(text)}
    assert kinds["01 step 200"] == "png" and kinds["01 step 10"] == "jpeg"  # PNG only where alpha shows
    steps = sorted({int(alt.split("step ")[1]) for alt in alts})
    assert steps[0] == 10 and steps[-1] == 200 and len(steps) == 12
    assert {alt.split(" ")[0] for alt in alts} == {f"{n:02d}" for n in range(16)}
    assert "shown: 12 of 20 validation steps; 16 of 20 pictures" in text
