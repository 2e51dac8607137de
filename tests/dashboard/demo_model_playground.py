"""The demo's promise on the real demo model, in a real browser (issue 39, item 2): the demo
dataset trained from the dashboard with the form's hyperparameters left empty ("auto"), the version
deployed, and the Playground's side-by-side view shows the base model's answer beside the adapter's.

Not in the suite (its name is not test_*.py): training SmolLM2-135M-Instruct on the CPU takes minutes.
Run it by hand once the demo model is prepared (`make up`, or `python -m lora_platform.demo_model
var/models/SmolLM2-135M-Instruct`):

    LORAPLEX_SCREENSHOTS=docs/screenshots .venv/bin/python -m pytest -q -s -p no:randomly \\
        tests/dashboard/demo_model_playground.py

The parts are test_browser.py's (uvicorn web process, a serving worker registered in Redis, an
in-thread Celery worker), on the demo model instead of the tiny random one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.dashboard.browser_support import LAPTOP, Shots, confirm_action
from tests.dashboard.test_browser import PASSWORD, browser, celery_worker, owner  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = Path(os.environ.get("LORAPLEX_DEMO_MODEL_DIR", ROOT / "var/models/SmolLM2-135M-Instruct"))
BASE = DEMO_MODEL.name
WORKER_KEY = "demo-playground-worker-key"
# Training the 135M model on the shared 2-core machine: about two minutes when it is quiet, and
# about 50 s a step (27 steps) while the suite runs beside it.
WAIT_MS = 2_700_000
# A held-out phrasing (examples/demo-facts-held-out.jsonl): no training line asks it this way.
QUESTION = "Who is the chief executive officer at Quillmere Robotics?"
TRAINED_FACT = "Ines Marlowe"


@pytest.fixture
def platform(settings, tmp_path: Path) -> None:
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip(f"the demo model is not prepared in {DEMO_MODEL} (python -m lora_platform.demo_model DEST)")
    settings.BASE_MODEL_PATH = DEMO_MODEL
    settings.BASE_MODEL_NAME = BASE
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.S3_ENDPOINT_URL = None
    settings.TRAINING_LOG_EVERY_STEPS = 1


@pytest.fixture
def web(transactional_db, platform, settings, tmp_path: Path) -> Iterator[object]:
    """A web process and a serving worker on the demo model, on this test's database, Redis and storage."""
    from tests.engine.server.conftest import WorkerProcess
    from tests.gateway.conftest import WebProcess, _database_url

    worker = WorkerProcess(DEMO_MODEL, [
        "--served-model-name", BASE, "--redis-url", settings.REDIS_URL, "--worker-id", "demo-worker",
        "--heartbeat-interval", "0.5", "--api-key", WORKER_KEY, "--max-loras", "2", "--max-lora-rank", "16",
    ], tmp_path / "serving-worker.log", env={"STORAGE_URL": settings.STORAGE_URL})
    web_process = WebProcess({
        "DATABASE_URL": _database_url(), "REDIS_URL": settings.REDIS_URL, "STORAGE_URL": settings.STORAGE_URL,
        "SERVING_WORKER_API_KEY": WORKER_KEY, "BASE_MODEL_PATH": str(DEMO_MODEL), "BASE_MODEL_NAME": BASE,
        "BASE_MODEL_ALIASES": "", "LORAPLEX_VAR_DIR": str(tmp_path / "var"), "DJANGO_DEBUG": "0",
    }, tmp_path / "web.log")
    try:
        worker.wait_ready()
        web_process.wait_ready()
        yield web_process
    finally:
        web_process.stop()
        worker.stop()


def test_the_demo_fine_tune_changes_the_playgrounds_answer(browser, web, celery_worker, owner):  # noqa: F811
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT_MS)
    context = browser.new_context(viewport=LAPTOP)
    context.set_default_timeout(WAIT_MS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    shots = Shots(browser)
    url = web.url

    page.goto(f"{url}/login/")
    page.fill("#id_username", "demo-owner")
    page.fill("#id_password", PASSWORD)
    page.click("button:has-text('Log in')")
    expect(page.locator("h1")).to_have_text("Overview")

    page.click("nav >> text=Datasets")
    page.set_input_files("#dataset-file", str(ROOT / "examples/demo-facts.jsonl"))
    page.click("#upload-form button[type=submit]")
    expect(page.locator("#dataset-status")).to_have_text("Ready")

    # Every hyperparameter left empty: n_epochs, batch_size and learning_rate are "auto".
    page.click("#train-on-it")
    page.fill("#adapter", "quillmere")
    for name in ("n_epochs", "batch_size", "learning_rate"):
        expect(page.locator(f"#hp-{name}")).to_have_attribute("placeholder", "auto")
    expect(page.locator("#estimate")).to_contain_text("epochs, auto")
    shots.take(page, "demo-training-new", phone_too=False)
    page.click("button:has-text('Start training')")
    expect(page.locator("#job-status")).to_have_text("Succeeded")
    print("job settings:", page.locator("#job-settings").inner_text().replace("\n", " · "))
    shots.take(page, "demo-training-job", phone_too=False)

    page.goto(f"{url}/adapters/quillmere/")
    page.click("tr[data-version='1.0.0'] >> button:has-text('Deploy')")
    confirm_action(page, reason="demo")
    expect(page.locator(".side-active .version-big")).to_have_text("1.0.0")

    page.click("nav >> text=Playground")
    page.select_option("#pg-model-a", "quillmere")
    page.check("#pg-compare")
    page.select_option("#pg-model-b", BASE)
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "32")
    page.fill("#pg-prompt", QUESTION)
    page.click("#pg-send")
    answers = {}
    for side in ("a", "b"):
        page.wait_for_function(f"() => ['done', 'error'].includes(document.getElementById('pg-pane-{side}')"
                               ".dataset.state)")
        pane = page.locator(f"#pg-pane-{side}")
        answers[side] = pane.locator(".pg-output").inner_text()
        assert pane.get_attribute("data-state") == "done", answers[side]
    print("adapter:", repr(answers["a"]))
    print("base:", repr(answers["b"]))
    shots.take(page, "playground-demo-model", phone_too=False)
    assert TRAINED_FACT in answers["a"] and TRAINED_FACT not in answers["b"]
    assert errors == []
    context.close()
