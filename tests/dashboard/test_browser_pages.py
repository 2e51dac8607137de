"""The dashboard's pages in a real browser (Debian's Chromium under Playwright), each rough edge of
issue 26 held: the Playground lists every model the gateway serves and hides its second model
until asked; registry actions take a reason into the audit trail and a canary its weight; pages
follow background work without a reload (a validated dataset gains "Train on it", a started job
drops its "queued" flash, a finished job lists its kept checkpoints); the Versions table's actions
fit a 390 px phone; the keys page sets a key's own limits; the pages link to the API docs and the
guides.

The web process is production's (uvicorn through the launcher's command line) on this test's
database; what background work would do (validate, train) is written to the database as the worker
writes it, since these tests are about the pages, not the worker (test_browser.py's journey runs the
real worker). With LORAPLEX_SCREENSHOTS=<dir> the pages are saved there.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.dashboard.browser_support import LAPTOP, PHONE, Shots, confirm_action, launched_browser

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

BASE = "tiny-llama"
WAIT_MS = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from launched_browser()


@pytest.fixture(scope="module")
def web(django_db_blocker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One web process for the file, on the test database (each test's rows are its own: the
    database is flushed between them)."""
    from django.conf import settings

    from tests.gateway.conftest import WebProcess, _database_url

    root = tmp_path_factory.mktemp("pages")
    with django_db_blocker.unblock():
        database_url = _database_url()
    process = WebProcess({
        "DATABASE_URL": database_url, "REDIS_URL": settings.REDIS_URL, "STORAGE_URL": f"file://{root / 'storage'}",
        "BASE_MODEL_PATH": str(root / BASE), "BASE_MODEL_NAME": BASE, "BASE_MODEL_ALIASES": "",
        "LORAPLEX_VAR_DIR": str(root / "var"), "DJANGO_DEBUG": "0", "SERVING_WORKER_API_KEY": "pages-worker-key",
    }, root / "web.log")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture
def owner(transactional_db, settings):
    from django.contrib.auth import get_user_model

    from tenants.models import Membership
    from tenants.services import tenant_create, tiers_seed

    settings.BASE_MODEL_NAME = BASE
    settings.BASE_MODEL_ALIASES = []
    tiers_seed()
    tenant, _ = tenant_create(slug="pages", tier_name="standard", name="Pages Co")
    # No password: the page signs in with a session (below), and hashing one with the default
    # hasher (a million PBKDF2 iterations, which e2e tests keep) cost a second of CPU a test.
    user = get_user_model().objects.create_user(username="pat", email="pat@example.com")
    Membership.objects.create(user=user, tenant=tenant, role="owner")
    return tenant


@pytest.fixture
def page(browser, web, owner) -> Iterator[object]:
    """A logged-in laptop page; JavaScript errors fail the test.

    Signed in as Django's test client's `force_login` does: a session row in the test database,
    which the web process reads, and its cookie in the browser. The sign-in form is not what these
    tests are about (test_browser.py's journey signs in through it, tests/tenants the form itself),
    and through it each test paid a password check (a second of PBKDF2) in the web process."""
    from django.contrib.auth import get_user_model
    from django.test import Client
    from playwright.sync_api import expect

    signed_in = Client()
    signed_in.force_login(get_user_model().objects.get(username="pat"))
    expect.set_options(timeout=WAIT_MS)
    context = browser.new_context(viewport=LAPTOP)
    context.add_cookies([{"name": name, "value": cookie.value, "url": web.url}
                         for name, cookie in signed_in.cookies.items()])
    context.set_default_timeout(WAIT_MS)
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(str(error)))
    opened.goto(f"{web.url}/")
    expect(opened.locator("h1")).to_have_text("Overview")
    yield opened
    context.close()
    assert errors == []


def version(adapter, text: str, **fields):
    from serving.registry.models import AdapterVersion

    values = dict(artifact_uri=f"file:///nowhere/{adapter.name}/{text}/",
                  manifest_sha256=hashlib.sha256(f"{adapter.name}@{text}".encode()).hexdigest(), base_model=BASE,
                  rank=8, lora_alpha=16.0, target_modules=["q_proj", "v_proj"], size_bytes=1024,
                  source=AdapterVersion.Source.UPLOAD)
    return AdapterVersion.objects.create(adapter=adapter, version=text, **{**values, **fields})


def test_the_playground_lists_every_servable_model_and_hides_the_second_until_asked(browser, web, owner, page):
    from playwright.sync_api import expect

    from serving.registry import services

    bot = services.adapter_create(tenant=owner, name="support-bot")
    services.adapter_version_deploy(version=version(bot, "1.0.0"), actor="test")
    services.adapter_canary_start(version=version(bot, "1.1.0"), weight=0.2, actor="test")
    version(bot, "1.2.0")
    services.adapter_version_archive(version=version(bot, "0.9.0"), actor="test")  # archived: never served
    version(services.adapter_create(tenant=owner, name="sql-bot"), "2.0.0")

    page.goto(f"{web.url}/playground/")
    options = page.locator("#pg-model-a option")
    assert options.evaluate_all("nodes => nodes.map(node => node.value)") == [
        BASE, "support-bot", "sql-bot@2.0.0", "support-bot@1.2.0", "support-bot@1.1.0", "support-bot@1.0.0"]
    expect(page.locator("#pg-model-a optgroup")).to_have_count(3)
    expect(page.locator("#pg-model-a")).to_have_value("support-bot")
    second = page.locator("#pg-model-b-field")
    expect(second).to_be_hidden()
    page.check("#pg-compare")
    expect(second).to_be_visible()
    expect(page.locator("#pg-pane-b")).to_be_visible()
    page.uncheck("#pg-compare")
    expect(second).to_be_hidden()
    Shots(browser).take(page, "playground-models")


def test_registry_actions_record_a_reason_and_a_canary_asks_its_weight(browser, web, owner, page):
    from playwright.sync_api import expect

    from serving.registry import services
    from serving.registry.models import DeploymentEvent

    bot = services.adapter_create(tenant=owner, name="support-bot")
    version(bot, "1.0.0")
    version(bot, "1.1.0")
    page.goto(f"{web.url}/adapters/support-bot/")
    page.click("tr[data-version='1.0.0'] >> button:has-text('Deploy')")
    expect(page.locator("#action-dialog-weight-field")).to_be_hidden()
    confirm_action(page, reason="first release")
    expect(page.locator(".side-active .version-big")).to_have_text("1.0.0")

    page.click("tr[data-version='1.1.0'] >> button:has-text('Canary')")
    expect(page.locator("#action-dialog-weight")).to_have_value("10")
    Shots(browser).take(page, "adapter-canary-dialog", phone_too=False)
    confirm_action(page, reason="new prompt format", weight=35)
    expect(page.locator(".side-canary .version-big")).to_have_text("1.1.0")
    expect(page.locator("#serving .card-head")).to_contain_text("35% of traffic to the canary")

    page.click("button:has-text('Abort canary')")
    page.click("#action-dialog button[value=cancel]")  # cancelled: nothing happens
    expect(page.locator(".side-canary .version-big")).to_have_text("1.1.0")

    events = {event.kind: event for event in DeploymentEvent.objects.filter(adapter=bot)}
    assert (events["deploy"].reason, events["deploy"].actor) == ("first release", "user:pat")
    assert (events["canary_start"].reason, events["canary_start"].to_weight) == ("new prompt format", 0.35)
    assert "abort" not in events
    expect(page.locator("#timeline")).to_contain_text("new prompt format")


def test_a_validated_dataset_gains_train_on_it_without_a_reload(web, owner, page):
    from playwright.sync_api import expect

    from training.models import Dataset

    dataset = Dataset.objects.create(tenant=owner, filename="support.jsonl", storage_key="datasets/pages/1.jsonl",
                                     sha256="0" * 64, size_bytes=100, status=Dataset.Status.VALIDATING)
    page.goto(f"{web.url}/datasets/{dataset.pk}/")
    expect(page.locator("#dataset-status")).to_have_text("Validating")
    expect(page.locator("#train-on-it")).to_have_count(0)
    page.evaluate("window.loadedOnce = true")
    # What the validation task writes when it ends.
    Dataset.objects.filter(pk=dataset.pk).update(
        status=Dataset.Status.READY, format=Dataset.Format.CHAT, num_examples=12,
        report={"errors": [], "warnings": [], "stats": {"num_examples": 12}})
    expect(page.locator("#train-on-it")).to_be_visible()
    expect(page.locator("#dataset-status")).to_have_text("Ready")
    assert page.evaluate("window.loadedOnce") is True  # the same page: no reload
    page.click("#train-on-it")
    expect(page.locator("#training_file")).to_have_value(str(dataset.pk))


def test_a_started_job_drops_its_queued_flash_and_a_finished_one_lists_its_checkpoints(browser, web, owner, page):
    from playwright.sync_api import expect

    from training.models import Checkpoint, Dataset, TrainingJob

    dataset = Dataset.objects.create(
        tenant=owner, filename="support.jsonl", storage_key="datasets/pages/2.jsonl", sha256="0" * 64,
        size_bytes=100, status=Dataset.Status.READY, format=Dataset.Format.CHAT, num_examples=12,
        report={"stats": {"num_examples": 12, "trained_tokens": 120}})
    page.goto(f"{web.url}/training/new/?dataset={dataset.pk}")
    page.fill("#adapter", "support-bot")
    page.click("button:has-text('Start training')")
    flash = page.locator("#flash")
    expect(flash).to_contain_text("is queued")
    expect(page.locator("#job-status")).to_have_text("Queued")
    job = TrainingJob.objects.get(adapter_name="support-bot")
    page.evaluate("window.loadedOnce = true")

    # What a worker writes: it starts, saves checkpoints, finishes.
    TrainingJob.objects.filter(pk=job.pk).update(status=TrainingJob.Status.RUNNING, step=4, total_steps=9)
    expect(page.locator("#job-status")).to_have_text("Running")
    expect(flash).to_be_hidden()
    expect(page.locator("#job-progress")).to_contain_text("None kept yet: one is saved every")
    for step in (4, 8):
        Checkpoint.objects.create(job=job, step=step, storage_prefix=f"checkpoints/pages/{job.pk}/step-{step}",
                                  metrics={"train_loss": 1.0 / step})
    TrainingJob.objects.filter(pk=job.pk).update(status=TrainingJob.Status.SUCCEEDED, step=9)
    expect(page.locator("#job-status")).to_have_text("Succeeded")
    rows = page.locator("#job-checkpoints tbody tr")
    expect(rows).to_have_count(2)
    assert rows.locator("td:first-child").all_inner_texts() == ["8", "4"]
    assert page.evaluate("window.loadedOnce") is True
    Shots(browser).take(page, "training-job-checkpoints")


def test_a_newcomer_watches_a_short_job_step_by_step(browser, web, owner, page):
    """Issue 39, item 6: beta only with DPO; the job says what it does before its first step; each
    logged step is a chart point at once, with tokens/s and the time left; no validation legend
    without validation examples."""
    from datetime import timedelta

    from django.utils import timezone
    from playwright.sync_api import expect

    from training.models import Dataset, TrainingEvent, TrainingJob

    dataset = Dataset.objects.create(
        tenant=owner, filename="demo.jsonl", storage_key="datasets/pages/3.jsonl", sha256="0" * 64,
        size_bytes=100, status=Dataset.Status.READY, format=Dataset.Format.CHAT, num_examples=36,
        report={"stats": {"num_examples": 36, "trained_tokens": 900}})
    page.goto(f"{web.url}/training/new/?dataset={dataset.pk}")
    expect(page.locator("#hp-beta")).to_be_hidden()
    page.select_option("#method", "dpo")
    expect(page.locator("#hp-beta")).to_be_visible()
    page.select_option("#method", "supervised")
    expect(page.locator("#hp-beta")).to_be_hidden()
    page.fill("#adapter", "demo-bot")
    shots = Shots(browser)
    shots.take(page, "training-new-watch", phone_too=False)
    page.click("button:has-text('Start training')")
    expect(page.locator("#job-waiting")).to_be_visible()
    job = TrainingJob.objects.get(adapter_name="demo-bot")
    assert "beta" not in job.hyperparameters or job.hyperparameters["method"] == "supervised"

    TrainingJob.objects.filter(pk=job.pk).update(status=TrainingJob.Status.RUNNING, total_steps=36)
    expect(page.locator("#job-preparing")).to_be_visible()
    expect(page.locator("#loss-chart")).to_contain_text("after the first step")
    chart = page.locator("#loss-chart")
    for step in range(1, 4):  # the first without a pace, then two with one: a point per poll each
        TrainingEvent.objects.create(job=job, type=TrainingEvent.Type.METRICS, message=f"Step {step}/36", data={
            "step": step, "train_loss": 2.5 - 0.3 * step, **({"tokens_per_second": 96.0} if step > 1 else {})})
        TrainingJob.objects.filter(pk=job.pk).update(
            step=step, estimated_finish=timezone.now() + timedelta(seconds=8 * (36 - step)) if step > 1 else None)
        expect(chart).to_have_attribute("data-points", str(step))
    expect(page.locator("#job-preparing")).to_have_count(0)
    expect(page.locator("#job-tokens-per-second")).to_have_text("96 trained tokens/s")
    expect(page.locator("#job-eta")).to_have_text(re.compile(r"^about \d+ min left$"))
    legend = page.locator("#loss-chart .u-legend")
    expect(legend).to_contain_text("train loss")
    expect(legend).not_to_contain_text("valid loss")
    shots.take(page, "training-job-watch")
    # The next job's form sizes it by this one's pace: 900 tokens × 3 epochs at 96 tokens/s.
    page.goto(f"{web.url}/training/new/?dataset={dataset.pk}")
    expect(page.locator("#estimate-duration")).to_have_text(" · about 28 s at your last job's 96 trained tokens/s")


def test_at_phone_width_every_versions_action_is_on_screen(browser, web, owner, page):
    from playwright.sync_api import expect

    from serving.registry import services

    bot = services.adapter_create(tenant=owner, name="a-rather-long-adapter-name")
    services.adapter_version_deploy(version=version(bot, "1.0.0"), actor="test")
    for text in ("1.0.1", "1.0.2-rc.1", "2.0.0"):
        version(bot, text)
    phone = browser.new_context(viewport=PHONE, storage_state=page.context.storage_state())
    try:
        small = phone.new_page()
        small.goto(f"{web.url}/adapters/{bot.name}/")
        buttons = small.locator("#versions .row-actions button")
        expect(buttons).to_have_count(9)  # deploy, canary and archive on each of the three ready versions
        for index in range(buttons.count()):
            box = buttons.nth(index).bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"], (index, box)
        # The page itself does not scroll sideways.
        assert small.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        small.locator("tr[data-version='2.0.0'] >> button:has-text('Canary')").click()
        confirm_action(small, weight=5)
        expect(small.locator(".side-canary .version-big")).to_have_text("2.0.0")
        if Shots(browser).directory is not None:
            small.goto(f"{web.url}/adapters/{bot.name}/")
            small.screenshot(path=str(Shots(browser).directory / "adapter-versions-phone.png"), full_page=True)
    finally:
        phone.close()


def test_the_keys_page_sets_a_keys_own_limits_and_revokes_with_a_reason(browser, web, owner, page):
    from playwright.sync_api import expect

    from tenants.models import ApiKey, TenantEvent

    page.goto(f"{web.url}/keys/")
    page.fill("#key-name", "batch job")
    page.click("summary:has-text('Limits of its own')")
    page.fill("#key-new-rpm", "20")
    page.fill("#key-new-budget", "100000")
    page.fill("#key-new-models", "support-bot, sql-bot@1.0.0")
    page.fill("#key-new-reason", "nightly batch")
    page.click("button:has-text('Create key')")
    expect(page.locator("#new-key-value")).to_be_visible()
    key = ApiKey.objects.get(name="batch job")
    assert (key.requests_per_minute, key.monthly_token_budget, key.allowed_models) == (
        20, 100_000, ["support-bot", "sql-bot@1.0.0"])
    row = page.locator(f"tr[data-key='{key.prefix}']")
    expect(row).to_contain_text("20 rpm")
    expect(row).to_contain_text("unknown: support-bot, sql-bot@1.0.0")  # no adapter of that name yet

    page.goto(f"{web.url}/keys/")
    page.locator(f"tr[data-key='{key.prefix}'] >> text=Limits").click()
    form = page.locator(f"#key-{key.pk}-limits")
    expect(form.locator("input[name=requests_per_minute]")).to_have_value("20")
    # Above the tier's: the form itself says so (its field's bound is the tier's), and nothing is sent.
    form.locator("input[name=tokens_per_minute]").fill("999999")
    form.locator("button:has-text('Save limits')").click()
    assert form.locator("input[name=tokens_per_minute]").evaluate("field => field.validity.rangeOverflow")
    key.refresh_from_db()
    assert key.tokens_per_minute is None
    form.locator("input[name=tokens_per_minute]").fill("5000")
    form.locator("input[name=reason]").fill("room for the backfill")
    form.locator("button:has-text('Save limits')").click()
    expect(page.locator("#flash")).to_contain_text("tokens per minute")
    expect(page.locator(f"tr[data-key='{key.prefix}']")).to_contain_text("5000 tpm")
    Shots(browser).take(page, "keys-limits")

    page.locator(f"tr[data-key='{key.prefix}'] >> button:has-text('Revoke')").click()
    confirm_action(page, reason="batch retired")
    expect(page.locator(f"tr[data-key='{key.prefix}']")).to_contain_text("Revoked")
    events = list(TenantEvent.objects.filter(subject__endswith="(batch job)").order_by("id"))
    assert [(event.kind, event.reason, event.actor) for event in events] == [
        ("key_create", "nightly batch", "user:pat"), ("key_update", "room for the backfill", "user:pat"),
        ("key_revoke", "batch retired", "user:pat")]
    expect(page.locator("#key-events")).to_contain_text("batch retired")


def test_the_dashboard_links_to_the_api_docs_and_the_guides(browser, web, owner, page):
    from playwright.sync_api import expect

    page.goto(f"{web.url}/")
    api_docs = page.locator("nav.sidebar >> text=API docs")
    assert api_docs.get_attribute("href") == "/api/docs/"
    assert httpx.get(f"{web.url}/api/docs/", timeout=30).status_code == 200
    page.click("nav.sidebar >> text=Guides")
    expect(page.locator("#guide h1")).to_have_text("Getting started")
    page.goto(f"{web.url}/keys/")
    page.click("text=the keys and limits guide")
    expect(page).to_have_url(re.compile(r"/guides/keys-and-limits/$"))
    expect(page.locator("#guide h1")).to_contain_text("API keys")
    Shots(browser).take(page, "guide-keys")
    # A link between guides lands on the other guide's page, at its heading.
    page.goto(f"{web.url}/guides/datasets/")
    page.locator("#guide a[href='/guides/training/#methods']").first.click()
    expect(page).to_have_url(re.compile(r"/guides/training/#methods$"))
    expect(page.locator("#methods")).to_be_in_viewport()
    for name in ("datasets", "training", "deploy", "api"):
        expect(page.locator(f".guide-index a[href='/guides/{name}/']")).to_have_count(1)
    assert page.goto(f"{web.url}/guides/gateway/").status == 404  # the developers' notes are not served
    assert page.goto(f"{web.url}/guides/nothing-here/").status == 404
