"""`manage.py registry deploy|canary|promote|abort|rollback`: the deployment operations from a shell,
through serving.registry.services (the same refusals as the dashboard and the API), each audited as the
operator with its reason; `--dry-run` changes nothing."""

from __future__ import annotations

import getpass
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from serving.registry.models import DeploymentEvent
from tests.registry.conftest import version

pytestmark = pytest.mark.django_db

OPERATOR = f"operator:{getpass.getuser()}"


def run(*args: str) -> str:
    out = StringIO()
    call_command("registry", *args, stdout=out)
    return out.getvalue()


def statuses(adapter) -> dict[str, tuple[str, float | None]]:
    return {item.version: (item.status, item.traffic_weight) for item in adapter.versions.all()}


def last_event() -> DeploymentEvent:
    return DeploymentEvent.objects.order_by("-id").first()


def test_deploy_canary_promote_and_rollback_change_the_registry_and_audit_each(deployed, make_version):
    make_version(deployed, "1.2.0")
    assert "alice-co/support-bot@1.1.0 is the canary, at 25% of the traffic." in run(
        "canary", "alice-co/support-bot@1.1.0", "--weight", "25%", "--reason", "try the new prompt")
    assert statuses(deployed)["1.1.0"] == ("canary", 0.25)
    event = last_event()
    assert (event.kind, event.to_version, event.to_weight, event.actor, event.reason) == (
        "canary_start", "1.1.0", 0.25, OPERATOR, "try the new prompt")

    run("canary", "alice-co/support-bot@1.1.0", "--weight", "0.5")  # the running canary: its weight changes
    assert statuses(deployed)["1.1.0"] == ("canary", 0.5)
    assert (last_event().kind, last_event().from_weight, last_event().to_weight) == ("canary_weight", 0.25, 0.5)

    assert "alice-co/support-bot@1.1.0 is promoted" in run("promote", "alice-co/support-bot", "--reason", "looks good")
    assert statuses(deployed)["1.1.0"] == ("active", None) and statuses(deployed)["1.0.0"][0] == "deprecated"
    assert (last_event().kind, last_event().reason) == ("promote", "looks good")

    run("deploy", "alice-co/support-bot@1.2.0", "--reason", "hotfix")
    assert statuses(deployed)["1.2.0"][0] == "active"
    assert (last_event().kind, last_event().from_version, last_event().actor) == ("deploy", "1.1.0", OPERATOR)

    assert "alice-co/support-bot@1.1.0 is the active version" in run("rollback", "alice-co/support-bot",
                                                                      "--reason", "hotfix broke sql")
    assert statuses(deployed)["1.1.0"][0] == "active"
    assert (last_event().kind, last_event().from_version, last_event().to_version, last_event().reason) == (
        "rollback", "1.2.0", "1.1.0", "hotfix broke sql")
    run("rollback", "alice-co/support-bot@1.0.0")  # to a named earlier version
    assert statuses(deployed)["1.0.0"][0] == "active"


def test_abort_stops_the_canary(deployed):
    run("canary", "alice-co/support-bot@1.1.0", "--weight", "10%")
    assert "The canary alice-co/support-bot@1.1.0 is aborted" in run("abort", "alice-co/support-bot",
                                                                      "--reason", "errors")
    assert statuses(deployed) == {"1.0.0": ("active", None), "1.1.0": ("deprecated", None)}
    assert (last_event().kind, last_event().reason) == ("abort", "errors")


def test_a_dry_run_checks_and_changes_nothing(deployed):
    before, events = statuses(deployed), DeploymentEvent.objects.count()
    assert "Dry run, nothing changed" in run("deploy", "alice-co/support-bot@1.1.0", "--dry-run")
    assert "Dry run" in run("canary", "alice-co/support-bot@1.1.0", "--weight", "10%", "--dry-run")
    assert (statuses(deployed), DeploymentEvent.objects.count()) == (before, events)
    with pytest.raises(CommandError, match="has no canary running"):
        run("promote", "alice-co/support-bot", "--dry-run")


def test_the_services_refusals_and_bad_names_are_command_errors(deployed, tenant_b):
    with pytest.raises(CommandError, match="already the active version"):
        run("deploy", "alice-co/support-bot@1.0.0")
    with pytest.raises(CommandError, match="has no canary running"):
        run("abort", "alice-co/support-bot")
    with pytest.raises(CommandError, match="no version '9.9.9'"):
        run("deploy", "alice-co/support-bot@9.9.9")
    with pytest.raises(CommandError, match="name a version as <tenant>/<adapter>@<version>"):
        run("deploy", "support-bot@1.1.0")
    with pytest.raises(CommandError, match="name an adapter as <tenant>/<adapter>"):
        run("promote", "support-bot")
    with pytest.raises(CommandError, match="No tenant 'nobody'"):
        run("promote", "nobody/support-bot")
    with pytest.raises(CommandError, match="No adapter named 'support-bot'"):  # bob's tenant has none
        run("promote", "bob-co/support-bot")
    with pytest.raises(CommandError, match="a share is from 0 to 1 \\(or a percentage: 30%\\)"):
        run("canary", "alice-co/support-bot@1.1.0", "--weight", "30")
    with pytest.raises(CommandError, match="--weight 'lots'"):
        run("canary", "alice-co/support-bot@1.1.0", "--weight", "lots")
    assert version(deployed, "1.1.0").status == "ready"
