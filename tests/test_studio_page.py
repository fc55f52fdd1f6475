"""The studio's page in a real browser (Playwright driving Debian's Chromium; skipped where it is not installed):
a bad value and an injected command refused on the page in qie's line, a training of the built-in demo data set
filled in the form at a few steps, two jobs queued, the first one's loss drawn live, stopped (its checkpoint saved),
resumed to its end and its report opened; a path outside the run folders refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from studio_helpers import start_studio

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(not CHROMIUM.is_file(), reason="Debian's Chromium (/usr/bin/chromium) is not installed"),
]
sync_api = pytest.importorskip("playwright.sync_api")
expect = sync_api.expect

# Where the test leaves its screenshots when asked (QIE_STUDIO_SHOTS=folder), to look at the page.
SHOTS = os.environ.get("QIE_STUDIO_SHOTS")


def test_the_demo_queued_watched_stopped_resumed_and_reported(tmp_path: Path, qie_home: Path) -> None:
    server = start_studio(tmp_path / "home")
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(60_000)
            expect.set_options(timeout=240_000)  # a job's state: imports, model and steps on a shared machine
            page.goto(server.base + "/")
            _refusals(page)
            first = _queue_two(page)
            _watch_stop_resume(page, first, Path(server.job(first)["run_dir"]))
            browser.close()
        outside = server.request(f"/files/run/{first}/%2E%2E/%2E%2E/queue.sqlite")
        assert outside.status == 404 and outside.body == {"error": "no such file in this job's run folder"}
    finally:
        server.stop()


def _shot(page, name: str) -> None:
    if SHOTS:
        page.screenshot(path=str(Path(SHOTS) / f"{name}.png"), full_page=False)


def _refusals(page) -> None:
    """A value out of range and a command injected into the overrides: qie's message on the page, nothing queued."""
    steps = page.locator('input[name="train.max_steps"]')
    steps.fill("-5")
    expect(page.locator("#error")).to_have_text("train.max_steps=-5 is out of range: it must lie in [0, inf]")
    page.click("#queue")
    expect(page.locator("#error")).to_have_text("train.max_steps=-5 is out of range: it must lie in [0, inf]")
    _shot(page, "refused")
    steps.fill("10")
    page.fill("#extra", "train.seed=1; rm -rf ~")
    expect(page.locator("#error")).to_have_text("LexerNoViableAltException: train.seed=1; rm -rf ~")
    page.fill("#extra", "")
    expect(page.locator("#error")).to_be_hidden()
    expect(page.locator("#jobs tbody tr")).to_have_count(0)


def _queue_two(page) -> int:
    """The built-in demo data at a few steps, encoded as it trains: queued twice; the second waits for the first and
    is stopped before it starts."""
    page.click('details[data-group="cache"] > summary')
    page.select_option('select[name="cache.mode"]', "live")
    page.fill('input[name="train.checkpoint_every"]', "1000")
    expect(page.locator("#command")).to_contain_text("train.max_steps=10 cache.mode=live train.checkpoint_every=1000")
    page.click("#queue")
    expect(page.locator("#jobs tbody tr")).to_have_count(1)
    page.click("#queue")
    expect(page.locator("#jobs tbody tr")).to_have_count(2)
    second = page.locator('#jobs tr[data-job="2"]')
    expect(second.locator(".state")).to_have_text("queued")
    expect(page.locator('#jobs tr[data-job="1"] .state')).to_have_text("running")
    _shot(page, "queue")
    second.get_by_role("button", name="stop").click()
    expect(second.locator(".state")).to_have_text("stopped")
    return 1


def _watch_stop_resume(page, job: int, run_dir: Path) -> None:
    page.locator(f'#jobs tr[data-job="{job}"]').get_by_role("button", name="watch").click()
    loss = page.locator('svg[aria-label="loss"] path[data-series="loss"]')
    expect(loss).to_have_count(1)  # the first logged step drawn
    _shot(page, "watch")
    page.click("#run-stop")
    expect(page.locator("#run-state")).to_have_text("stopped")
    expect(page.locator("#run-message")).to_contain_text("stopped by signal 15")
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
    assert saved and saved[-1] != "step-000010", saved
    page.click("#run-resume")
    expect(page.locator("#run-title")).to_have_text("job 3: train")
    expect(page.locator("#run-state")).to_have_text("done")
    expect(loss).to_have_attribute("data-points", "10")  # the first run's steps and the resumed ones
    expect(page.locator("#run-progress span")).to_have_text("step 10 of 10")
    _shot(page, "done")
    with page.expect_popup() as opened:
        page.click("#run-report")
    report = opened.value
    report.wait_for_load_state()
    assert "step 10" in report.content() and "train.resume=latest" in report.content()
    _shot(report, "report")
