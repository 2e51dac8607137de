"""Dashboard views: who may see and do what, CSRF on every form, services behind every action, no N+1."""

from __future__ import annotations

import json

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from serving.registry import services as registry
from serving.registry.models import Adapter, DeploymentEvent
from tenants.models import ApiKey
from training import datasets, jobs
from training.models import Dataset, TrainingJob
from usage_records import record

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]

GOOD = b"".join(json.dumps({"messages": [{"role": "user", "content": f"Question {n}?"},
                                         {"role": "assistant", "content": f"Answer {n}."}]}).encode() + b"\n"
                for n in range(12))
BROKEN = GOOD.splitlines(keepends=True)[0] + b'{"messages": [{"role": "user", "content": "no answer"\n'


def upload(tenant, content: bytes, name: str = "data.jsonl", validate: bool = True) -> Dataset:
    from django.core.files.uploadedfile import SimpleUploadedFile

    dataset = datasets.dataset_create(tenant=tenant, source=SimpleUploadedFile(name, content), filename=name,
                                      size=len(content))
    return datasets.dataset_validate(dataset_id=dataset.pk) if validate else dataset


@pytest.fixture(autouse=True)
def storage(settings, tmp_path):
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.BASE_MODEL_PATH = tmp_path / "no-model"  # no tokenizer: token statistics are skipped


PAGES = ["dashboard:overview", "dashboard:datasets", "dashboard:jobs", "dashboard:adapters", "dashboard:keys",
         "dashboard:usage", "dashboard:members"]


@pytest.mark.parametrize("page", PAGES)
def test_pages_need_a_login(client, page):
    response = client.get(reverse(page))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("dashboard:login"))


def test_login_with_a_password_lands_on_the_overview(client, people):
    response = client.post(reverse("dashboard:login"), {"username": "olivia", "password": "correct-horse-battery"},
                           follow=True)
    assert response.redirect_chain[-1][0] == reverse("dashboard:overview")
    assert b"Alice-Co" in response.content
    refused = Client().post(reverse("dashboard:login"), {"username": "olivia", "password": "wrong"})
    assert refused.status_code == 200 and b"did not match" in refused.content


@pytest.mark.parametrize("page", PAGES)
def test_every_role_reads_every_page(as_user, people, page):
    for user in (people.owner, people.member, people.viewer):
        assert as_user(user).get(reverse(page)).status_code == 200


def test_a_user_without_a_tenant_is_told_so(as_user, db):
    from django.contrib.auth import get_user_model

    loner = get_user_model().objects.create_user(username="loner", password="x")
    response = as_user(loner).get(reverse("dashboard:overview"))
    assert response.status_code == 403


def test_another_tenants_objects_are_404(as_user, people, tenant_b, make_version):
    dataset = upload(tenant_b.tenant, GOOD)
    adapter = registry.adapter_create(tenant=tenant_b.tenant, name="bobs-bot")
    make_version(adapter, "1.0.0")
    job = jobs.training_job_create(tenant=tenant_b.tenant, training_file=dataset.pk, adapter="bobs-bot")
    key = ApiKey.objects.filter(tenant=tenant_b.tenant).first()
    client = as_user(people.owner)
    assert client.get(reverse("dashboard:dataset", args=[dataset.pk])).status_code == 404
    assert client.get(reverse("dashboard:job", args=[job.pk])).status_code == 404
    assert client.get(reverse("dashboard:adapter", args=["bobs-bot"])).status_code == 404
    for url, data in [(reverse("dashboard:adapter-deploy", args=["bobs-bot"]), {"version": "1.0.0"}),
                      (reverse("dashboard:job-cancel", args=[job.pk]), {}),
                      (reverse("dashboard:job-pause", args=[job.pk]), {}),
                      (reverse("dashboard:dataset-delete", args=[dataset.pk]), {}),
                      (reverse("dashboard:key-revoke", args=[key.pk]), {})]:
        assert client.post(url, data).status_code == 404, url
    key.refresh_from_db()
    assert key.revoked_at is None
    assert not DeploymentEvent.objects.filter(kind=DeploymentEvent.Kind.DEPLOY).exists()
    assert client.get(reverse("dashboard:datasets")).content.count(b"data.jsonl") == 0


def test_a_dora_version_shows_its_kind(as_user, people, tenant_a, make_version):
    adapter = registry.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    make_version(adapter, "1.0.0")
    page = as_user(people.viewer).get(reverse("dashboard:adapter", args=["support-bot"])).content
    assert b'class="kind"' not in page  # plain LoRA: the rank alone
    make_version(adapter, "1.1.0", kind="dora")
    page = as_user(people.viewer).get(reverse("dashboard:adapter", args=["support-bot"])).content
    assert b'<span class="kind" title="adapter kind (docs/adapter-kinds.md)">DoRA</span>' in page


def test_viewers_read_but_do_not_act(as_user, people, tenant_a, make_version):
    dataset = upload(tenant_a.tenant, GOOD)
    adapter = registry.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    make_version(adapter, "1.0.0")
    client = as_user(people.viewer)
    page = client.get(reverse("dashboard:adapter", args=["support-bot"]))
    assert page.status_code == 200 and b">Deploy<" not in page.content
    refused = [
        (reverse("dashboard:adapter-deploy", args=["support-bot"]), {"version": "1.0.0"}),
        (reverse("dashboard:adapter-create"), {"name": "another"}),
        (reverse("dashboard:job-create"), {"training_file": dataset.pk, "adapter": "x"}),
        (reverse("dashboard:dataset-delete", args=[dataset.pk]), {}),
        (reverse("dashboard:key-create"), {"name": "mine", "scopes": ["inference"]}),
    ]
    for url, data in refused:
        assert client.post(url, data).status_code == 403, url
    assert client.get(reverse("dashboard:job-new")).status_code == 403
    assert client.get(reverse("dashboard:playground")).status_code == 403
    assert client.post(reverse("dashboard:playground-key")).status_code == 403
    assert not TrainingJob.objects.exists()
    assert Adapter.objects.count() == 1
    assert ApiKey.objects.filter(tenant=tenant_a.tenant).count() == 1


def test_members_act_but_only_owners_manage_keys(as_user, people, tenant_a, make_version):
    adapter = registry.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    make_version(adapter, "1.0.0")
    member = as_user(people.member)
    deployed = member.post(reverse("dashboard:adapter-deploy", args=["support-bot"]), {"version": "1.0.0"})
    assert deployed.status_code == 302
    assert adapter.versions.get().status == "active"
    assert member.post(reverse("dashboard:key-create"), {"name": "k", "scopes": ["inference"]}).status_code == 403
    keys_page = member.get(reverse("dashboard:keys"))
    assert b"Create a key" not in keys_page.content and b">Revoke<" not in keys_page.content


def test_a_new_key_is_shown_once_and_can_be_revoked(as_user, people, tenant_a):
    client = as_user(people.owner)
    response = client.post(reverse("dashboard:key-create"), {"name": "production", "scopes": ["inference"]})
    assert response.status_code == 200
    secret = response.context["created_secret"]
    assert secret.startswith("lp-") and secret.encode() in response.content
    key = ApiKey.objects.get(tenant=tenant_a.tenant, name="production")
    assert key.scopes == ["inference"]
    listing = client.get(reverse("dashboard:keys"))
    assert secret.encode() not in listing.content and f"lp-{key.prefix}".encode() in listing.content
    refused = client.post(reverse("dashboard:key-create"), {"name": "bad", "scopes": ["everything"]})
    assert refused.status_code == 400 and b"Unknown scope" in refused.content
    client.post(reverse("dashboard:key-revoke", args=[key.pk]))
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_a_keys_limits_are_changed_by_owners_only_and_a_refusal_shows_on_its_form(as_user, people, tenant_a,
                                                                                  tenant_b):
    key = ApiKey.objects.get(tenant=tenant_a.tenant)
    url = reverse("dashboard:key-update", args=[key.pk])
    assert as_user(people.member).post(url, {"requests_per_minute": "5"}).status_code == 403
    owner = as_user(people.owner)
    refused = owner.post(url, {"requests_per_minute": "5000", "monthly_token_budget": "10"})
    assert refused.status_code == 400
    assert refused.context["error_key"] == key.pk and b"above the &#x27;standard&#x27; tier" in refused.content
    key.refresh_from_db()
    assert (key.requests_per_minute, key.monthly_token_budget) == (None, None)
    saved = owner.post(url, {"requests_per_minute": "5", "allowed_models": "support-bot\nsql-bot@1.0.0, x",
                             "expires_at": "2099-01-31T12:30", "reason": "rotation"}, follow=True)
    assert b"expires at, allowed models, requests per minute saved" in saved.content
    key.refresh_from_db()
    assert (key.requests_per_minute, key.allowed_models, key.expires_at.isoformat()) == (
        5, ["support-bot", "sql-bot@1.0.0", "x"], "2099-01-31T12:30:00+00:00")
    # The form sends every field; unchanged ones change nothing (no audit event of their own).
    again = owner.post(url, {"requests_per_minute": "5", "allowed_models": "support-bot, sql-bot@1.0.0, x",
                             "expires_at": "2099-01-31T12:30"}, follow=True)
    assert b"nothing to change" in again.content
    bobs = ApiKey.objects.get(tenant=tenant_b.tenant)
    assert owner.post(reverse("dashboard:key-update", args=[bobs.pk]), {"requests_per_minute": "1"}).status_code == 404


def test_the_switcher_changes_tenant_only_to_the_users_own(as_user, people, tenant_a, tenant_b):
    from tenants.authentication import SESSION_TENANT_KEY
    from tenants.models import Membership

    Membership.objects.create(user=people.owner, tenant=tenant_b.tenant, role="viewer")
    client = as_user(people.owner)
    page = client.get(reverse("dashboard:overview"))
    assert b'id="tenant-switch"' in page.content
    client.post(reverse("dashboard:tenant-switch"), {"tenant": "bob-co"})
    assert client.session[SESSION_TENANT_KEY] == tenant_b.tenant.pk
    switched = client.get(reverse("dashboard:overview"))
    assert switched.context["request"].dashboard.tenant == tenant_b.tenant
    assert switched.context["request"].dashboard.role == "viewer"
    # The session-authenticated API acts for the same tenant.
    assert client.get("/api/v1/tenant").json()["slug"] == "bob-co"
    bob_only = as_user(people.bob)
    assert bob_only.post(reverse("dashboard:tenant-switch"), {"tenant": "alice-co"}).status_code == 404


def test_dataset_upload_and_its_line_numbered_report(as_user, people, tenant_a, django_capture_on_commit_callbacks):
    from django.core.files.uploadedfile import SimpleUploadedFile

    client = as_user(people.member)
    response = client.post(reverse("dashboard:dataset-upload"),
                           {"file": SimpleUploadedFile("broken.jsonl", BROKEN)})
    dataset = Dataset.objects.get(tenant=tenant_a.tenant)
    assert response.status_code == 302 and response["Location"] == reverse("dashboard:dataset", args=[dataset.pk])
    pending = client.get(response["Location"])
    assert b"every 2s [document.visibilityState === 'visible']" in pending.content
    datasets.dataset_validate(dataset_id=dataset.pk)
    report = client.get(response["Location"])
    assert b"invalid_json" in report.content
    assert report.context["report"]["errors"][0]["line"] == 2
    assert b"hx-trigger" not in report.content  # validation is over: polling stops
    empty = client.post(reverse("dashboard:dataset-upload"), {"file": SimpleUploadedFile("empty.jsonl", b"")},
                        follow=True)
    assert b"empty" in empty.content and Dataset.objects.count() == 1
    htmx = client.post(reverse("dashboard:dataset-upload"), {"file": SimpleUploadedFile("ok.jsonl", GOOD)},
                       HTTP_HX_REQUEST="true")
    assert htmx.status_code == 204 and htmx["HX-Redirect"].startswith("/datasets/")


def test_dataset_upload_stops_at_the_tiers_limit(as_user, people, settings):
    from django.core.files.uploadedfile import SimpleUploadedFile

    settings.TRAINING_DATASET_MAX_BYTES = 100
    response = as_user(people.member).post(reverse("dashboard:dataset-upload"),
                                           {"file": SimpleUploadedFile("big.jsonl", GOOD)}, follow=True)
    assert b"at most 100 bytes" in response.content
    assert not Dataset.objects.exists()


def test_the_preview_shows_an_examples_tool_calls(as_user, people, tenant_a):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    line = {"tools": [{"type": "function", "function": {"name": "get_weather"}}],
            "messages": [{"role": "user", "content": "Weather in Rome?"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
                         {"role": "assistant", "content": "It is sunny."}]}
    dataset = upload(tenant_a.tenant, (json.dumps(line) + "\n").encode())
    page = as_user(people.member).get(reverse("dashboard:dataset", args=[dataset.pk]))
    assert page.status_code == 200 and dataset.status == "ready"
    assert b"get_weather({&#x27;city&#x27;: &#x27;Rome&#x27;})" in page.content
    assert b'turn-tool"><span class="role">tool</span><div class="bubble">Sunny.' in page.content


def test_job_form_errors_keep_the_values_and_success_queues_a_job(as_user, people, tenant_a):
    dataset = upload(tenant_a.tenant, GOOD)
    client = as_user(people.member)
    assert client.get(reverse("dashboard:job-new")).status_code == 200
    form = {"training_file": str(dataset.pk), "adapter": "support-bot", "n_epochs": "2", "r": "999",
            "target_modules": ["q_proj", "v_proj"]}
    refused = client.post(reverse("dashboard:job-create"), form)
    assert refused.status_code == 400
    assert b"Hyperparameter &#x27;r&#x27; is 999" in refused.content and b'value="support-bot"' in refused.content
    form["r"] = "4"
    created = client.post(reverse("dashboard:job-create"), form)
    job = TrainingJob.objects.get()
    assert created["Location"] == reverse("dashboard:job", args=[job.pk])
    assert job.hyperparameters["r"] == 4 and job.hyperparameters["n_epochs"] == 2
    assert job.hyperparameters["target_modules"] == ["q_proj", "v_proj"]
    page = client.get(created["Location"])
    assert b"every 2s" in page.content and b"Cancel job" in page.content
    client.post(reverse("dashboard:job-cancel", args=[job.pk]))
    job.refresh_from_db()
    assert job.status == "cancelled"
    assert b"hx-trigger" not in client.get(created["Location"], HTTP_HX_REQUEST="true").content


def test_registry_actions_write_the_same_audit_events_as_the_api(as_user, people, tenant_a, make_version):
    """The same deploy → canary → weight → promote → rollback → canary → abort through both paths."""
    client = as_user(people.owner)
    for name in ("via-dashboard", "via-api"):
        adapter = registry.adapter_create(tenant=tenant_a.tenant, name=name)
        for version in ("1.0.0", "1.1.0", "1.2.0"):
            make_version(adapter, version)
    steps = [
        ("adapter-deploy", {"version": "1.0.0"}, "post", "versions/1.0.0/deploy", {}),
        ("adapter-canary", {"version": "1.1.0", "weight": "20"}, "post", "canary", {"version": "1.1.0", "weight": 0.2}),
        ("adapter-canary", {"weight": "50"}, "patch", "canary", {"weight": 0.5}),
        ("adapter-promote", {}, "post", "canary/promote", {}),
        ("adapter-rollback", {}, "post", "rollback", {}),
        ("adapter-canary", {"version": "1.2.0", "weight": "10"}, "post", "canary", {"version": "1.2.0", "weight": 0.1}),
        ("adapter-abort", {"reason": "too slow"}, "post", "canary/abort", {"reason": "too slow"}),
    ]
    for route, form, method, api_path, body in steps:
        response = client.post(reverse(f"dashboard:{route}", args=["via-dashboard"]), form)
        assert response.status_code == 302
        api = getattr(client, method)(f"/api/v1/adapters/via-api/{api_path}", body, content_type="application/json")
        assert api.status_code == 200, api.content

    def trail(name: str) -> list[tuple]:
        return list(DeploymentEvent.objects.filter(adapter_name=name).order_by("id").values_list(
            "kind", "from_version", "to_version", "from_weight", "to_weight", "actor", "reason"))

    assert trail("via-dashboard") == trail("via-api")
    assert trail("via-dashboard")[-1][5] == "user:olivia"
    page = client.get(reverse("dashboard:adapter", args=["via-dashboard"]))
    assert page.content.count(b'<li class="event-') == len(trail("via-dashboard"))


def test_a_refused_registry_action_says_why(as_user, people, tenant_a, make_version):
    adapter = registry.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    make_version(adapter, "1.0.0")
    client = as_user(people.member)
    response = client.post(reverse("dashboard:adapter-promote", args=["support-bot"]), follow=True)
    assert b"no canary" in response.content.lower()
    bad = client.post(reverse("dashboard:adapter-canary", args=["support-bot"]), {"weight": "lots"}, follow=True)
    assert b"percentage from 0 to 100" in bad.content


POST_ROUTES = [
    ("dashboard:tenant-switch", []), ("dashboard:dataset-upload", []), ("dashboard:dataset-delete", [1]),
    ("dashboard:job-create", []), ("dashboard:job-cancel", [1]), ("dashboard:job-pause", [1]),
    ("dashboard:job-resume", [1]), ("dashboard:job-checkpoint-version", [1, 8]), ("dashboard:adapter-create", []),
    ("dashboard:adapter-upload", ["x"]), ("dashboard:adapter-deploy", ["x"]), ("dashboard:adapter-canary", ["x"]),
    ("dashboard:adapter-promote", ["x"]), ("dashboard:adapter-abort", ["x"]), ("dashboard:adapter-rollback", ["x"]),
    ("dashboard:adapter-archive", ["x"]), ("dashboard:key-create", []), ("dashboard:key-update", [1]),
    ("dashboard:key-revoke", [1]),
    ("dashboard:logout", []), ("dashboard:playground-key", []), ("dashboard:member-add", []),
    ("dashboard:member-role", [1]), ("dashboard:member-remove", [1]),
]


@pytest.mark.parametrize("route,args", POST_ROUTES)
def test_every_form_needs_its_csrf_token(people, route, args):
    client = Client(enforce_csrf_checks=True)
    client.force_login(people.owner)
    assert client.post(reverse(route, args=args), {}).status_code == 403


def test_every_post_route_is_covered_by_the_csrf_test():
    from dashboard import urls as dashboard_urls

    posted = {name for name, _ in POST_ROUTES}
    reads = {"overview", "login", "datasets", "dataset", "jobs", "job-new", "job", "adapters", "adapter", "keys",
             "playground", "usage", "usage-csv", "members", "guides", "guide"}
    assert {f"dashboard:{item.name}" for item in dashboard_urls.urlpatterns} == posted | {f"dashboard:{n}" for n in reads}


def test_a_job_handed_back_by_a_clean_stop_shows_interrupted_and_where_it_resumes(as_user, people, tenant_a):
    from django.utils import timezone

    dataset = upload(tenant_a.tenant, GOOD, validate=False)
    job = TrainingJob.objects.create(tenant=tenant_a.tenant, dataset=dataset, adapter_name="support-bot",
                                     base_model="tiny", seed=1, status="running", interrupted_at=timezone.now())
    job.checkpoints.create(step=4, storage_prefix="c/4")
    job.checkpoints.create(step=8, storage_prefix="c/8")
    client = as_user(people.viewer)
    page = client.get(reverse("dashboard:job", args=[job.pk]), HTTP_HX_REQUEST="true").content.decode()
    assert 'id="job-interrupted"' in page and "resuming from step 8" in page
    TrainingJob.objects.filter(pk=job.pk).update(interrupted_at=None)  # a worker took it back
    assert 'id="job-interrupted"' not in client.get(reverse("dashboard:job", args=[job.pk])).content.decode()


def _fill(tenant, rows: range, make_version) -> None:
    """Each row: a dataset, an adapter with an active and a canary version, a job with an event and a
    checkpoint, and an API key."""
    from tenants.services import api_key_create

    for n in rows:
        dataset = upload(tenant, GOOD, name=f"d{n}.jsonl", validate=False)
        Dataset.objects.filter(pk=dataset.pk).update(status="ready", num_examples=12, format="chat")
        adapter = registry.adapter_create(tenant=tenant, name=f"adapter-{n}")
        version = make_version(adapter, "1.0.0")
        registry.adapter_version_deploy(version=version, actor="test")
        make_version(adapter, "1.1.0")
        registry.adapter_canary_start(version=adapter.versions.get(version="1.1.0"), weight=0.1, actor="test")
        job = TrainingJob.objects.create(tenant=tenant, dataset=dataset, adapter_name=f"adapter-{n}",
                                         base_model="tiny", seed=1, adapter_version=version)
        job.events.create(message="metrics", type="metrics", data={"step": n, "train_loss": 1.0})
        job.checkpoints.create(step=n + 1, storage_prefix=f"c/{n}")
        _, full_key = api_key_create(tenant=tenant, name=f"key {n}")
        for version in ("1.0.0", "1.1.0"):
            record(tenant, adapter=f"adapter-{n}", version=version, key=full_key[3:15])


@pytest.mark.parametrize("page,args", [
    ("dashboard:overview", []), ("dashboard:datasets", []), ("dashboard:jobs", []), ("dashboard:adapters", []),
    ("dashboard:keys", []), ("dashboard:job-new", []), ("dashboard:adapter", ["adapter-0"]),
    ("dashboard:job", None), ("dashboard:usage", []), ("dashboard:playground", []), ("dashboard:members", []),
])
@pytest.mark.slow
def test_query_counts_do_not_grow_with_rows(as_user, people, tenant_a, make_version, page, args):
    from tenants.models import Tier

    tenant_a.tenant.tier = Tier.objects.get(name="vip")  # room for 30 adapters
    tenant_a.tenant.save()
    client = as_user(people.owner)

    def count() -> int:
        url_args = args if args is not None else [TrainingJob.objects.order_by("id").first().pk]
        client.get(reverse(page, args=url_args))  # warm the session and caches
        with CaptureQueriesContext(connection) as queries:
            assert client.get(reverse(page, args=url_args)).status_code == 200
        return len(queries)

    _fill(tenant_a.tenant, range(3), make_version)
    few = count()
    # Five rows more of each kind: a query per row would add at least five. No page lists fewer than
    # eight rows, and filling more cost seconds per page on the 2-core machine.
    _fill(tenant_a.tenant, range(3, 8), make_version)
    assert count() == few


def test_owners_manage_members_and_a_tenant_keeps_an_owner(as_user, people, tenant_a, tenant_b):
    from tenants.models import Membership

    owner = as_user(people.owner)
    assert owner.post(reverse("dashboard:member-add"), {"user": "bob@example.com", "role": "viewer"}).status_code == 302
    bob = Membership.objects.get(tenant=tenant_a.tenant, user=people.bob)
    assert bob.role == "viewer"
    again = owner.post(reverse("dashboard:member-add"), {"user": "bob", "role": "viewer"}, follow=True)
    assert b"already a member" in again.content
    unknown = owner.post(reverse("dashboard:member-add"), {"user": "nobody", "role": "viewer"}, follow=True)
    assert b"No user" in unknown.content
    owner.post(reverse("dashboard:member-role", args=[bob.pk]), {"role": "member"})
    bob.refresh_from_db()
    assert bob.role == "member"
    mine = Membership.objects.get(tenant=tenant_a.tenant, user=people.owner)
    last = owner.post(reverse("dashboard:member-role", args=[mine.pk]), {"role": "viewer"}, follow=True)
    assert b"last owner" in last.content and Membership.objects.get(pk=mine.pk).role == "owner"
    assert b"last owner" in owner.post(reverse("dashboard:member-remove", args=[mine.pk]), follow=True).content
    owner.post(reverse("dashboard:member-remove", args=[bob.pk]))
    assert not Membership.objects.filter(pk=bob.pk).exists()
    # Members and viewers read the list but change nothing; another tenant's membership is a 404.
    member = as_user(people.member)
    assert b"Add a member" not in member.get(reverse("dashboard:members")).content
    viewer_row = Membership.objects.get(tenant=tenant_a.tenant, user=people.viewer)
    assert member.post(reverse("dashboard:member-role", args=[viewer_row.pk]), {"role": "owner"}).status_code == 403
    bobs_own = Membership.objects.get(tenant=tenant_b.tenant, user=people.bob)
    assert as_user(people.owner).post(reverse("dashboard:member-remove", args=[bobs_own.pk])).status_code == 404


def test_a_job_is_paused_and_resumed_from_its_page(as_user, people, tenant_a):
    dataset = upload(tenant_a.tenant, GOOD)
    job = jobs.training_job_create(tenant=tenant_a.tenant, training_file=dataset.pk, adapter="support-bot")
    url = reverse("dashboard:job", args=[job.pk])
    assert 'id="job-pause"' not in as_user(people.viewer).get(url).content.decode()  # viewers read only
    client = as_user(people.member)
    assert 'id="job-pause"' in client.get(url).content.decode()

    paused = client.post(reverse("dashboard:job-pause", args=[job.pk]), follow=True).content.decode()
    job.refresh_from_db()
    assert job.status == "paused"
    assert f"Job {job.pk} is paused." in paused and 'id="job-paused"' in paused and 'id="job-resume"' in paused
    assert "status-paused" in paused and ">Paused<" in paused
    assert "hx-trigger" not in client.get(url, HTTP_HX_REQUEST="true").content.decode()  # nothing to poll for

    resumed = client.post(reverse("dashboard:job-resume", args=[job.pk]), follow=True).content.decode()
    job.refresh_from_db()
    assert job.status == "queued" and 'id="job-pause"' in resumed and "every 2s" in resumed
    refused = client.post(reverse("dashboard:job-resume", args=[job.pk]), follow=True).content.decode()
    assert "is queued, not paused" in refused
