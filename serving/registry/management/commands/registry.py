"""`python manage.py registry …`: the operator's adapter registry commands.

- `export|import FILE`: the deployed state as YAML (serving.registry.registry_file).
- `deploy|canary|promote|abort|rollback`: the deployment operations, through serving.registry.services as
  the dashboard, the REST API and the admin call them (the same checks and errors, one audit event
  each, actor `operator:<login name>`, with `--reason`); `--dry-run` checks without changing.

Versions are named as the registry names them, `<tenant>/<adapter>@<version>`, adapters as
`<tenant>/<adapter>` (docs/registry.md, "From the command line").
"""

from __future__ import annotations

import sys
from argparse import ArgumentParser
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from django.core.management.base import BaseCommand, CommandError

from serving.registry import selectors, services
from serving.registry.models import Adapter, AdapterVersion
from serving.registry.registry_file import registry_export, registry_import
from serving.contracts.errors import ServiceError
from serving.contracts.names import parse_qualified_name
from tenants.models import Tenant
from tenants.services import operator_actor

ACTOR = "operator:registry-import"


class Command(BaseCommand):
    help = "Export the adapter registry to a YAML file, or restore the state a file describes."

    def add_arguments(self, parser: ArgumentParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True,
                                        metavar="{export,import,deploy,canary,promote,abort,rollback}")
        export = actions.add_parser("export", help="Write every version with its status and traffic weight.")
        export.add_argument("file", help="where to write the YAML ('-' for standard output)")
        export.add_argument("--tenant", help="only this tenant's adapters (a slug)")
        restore = actions.add_parser("import", help="Register missing versions from their artifacts and bring "
                                                    "active versions, canaries and weights to the file's state.")
        restore.add_argument("file", help="a YAML file written by export (or in its shape; '-' for standard input)")
        restore.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
        for name, target, text in (
                ("deploy", "version", "Make a version active (the active one becomes deprecated)."),
                ("canary", "version", "Serve a version beside the active one to --weight of the traffic, or "
                                      "change the running canary's weight."),
                ("promote", "adapter", "Make the running canary the active version."),
                ("abort", "adapter", "Stop the running canary; all traffic returns to the active version."),
                ("rollback", "adapter", "Return to the version that was active before (or to ADAPTER@VERSION).")):
            action = actions.add_parser(name, help=text)
            if target == "version":
                action.add_argument("version", metavar="TENANT/ADAPTER@VERSION", help="e.g. acme/support-bot@1.2.0")
            else:
                action.add_argument("adapter", metavar="TENANT/ADAPTER[@VERSION]" if name == "rollback"
                                    else "TENANT/ADAPTER", help="e.g. acme/support-bot")
            if name == "canary":
                action.add_argument("--weight", required=True, help="its share of the traffic: 10%% or 0.1")
            action.add_argument("--reason", default="", help="why; kept in the audit log")
            action.add_argument("--dry-run", action="store_true", help="run the checks, change nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            getattr(self, f"_{options['action']}")(options)
        except ServiceError as error:
            raise CommandError(error.message) from error

    def _export(self, options: dict[str, Any]) -> None:
        tenant = None
        if options["tenant"]:
            tenant = Tenant.objects.filter(slug=options["tenant"]).first()
            if tenant is None:
                raise CommandError(f"No tenant '{options['tenant']}'.")
        document = registry_export(tenant=tenant)
        header = (f"# Loraplex adapter registry, exported {datetime.now(UTC).isoformat(timespec='seconds')}.\n"
                  "# Restore with: python manage.py registry import FILE\n")
        text = header + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)
        if options["file"] == "-":
            self.stdout.write(text, ending="")
        else:
            Path(options["file"]).write_text(text)
            self.stdout.write(self.style.SUCCESS(f"Wrote {len(document['adapters'])} version(s) to {options['file']}."))

    def _import(self, options: dict[str, Any]) -> None:
        try:
            text = sys.stdin.read() if options["file"] == "-" else Path(options["file"]).read_text()
            document = yaml.safe_load(text)
        except OSError as error:
            raise CommandError(f"Cannot read {options['file']}: {error}") from error
        except yaml.YAMLError as error:
            raise CommandError(f"{options['file']} is not valid YAML: {error}") from error
        done = registry_import(document=document, actor=ACTOR, dry_run=options["dry_run"])
        prefix = "would have " if options["dry_run"] else ""
        for line in done:
            self.stdout.write(f"{prefix}{line}")
        summary = f"{len(done)} change(s)" if done else "nothing to change: the registry already matches"
        self.stdout.write(self.style.SUCCESS(f"{'Dry run: ' if options['dry_run'] else ''}{summary}."))

    def _done(self, options: dict[str, Any], text: str) -> None:
        if options["dry_run"]:
            self.stdout.write(f"Dry run, nothing changed: {text[0].lower()}{text[1:]} would be allowed.")
        else:
            self.stdout.write(self.style.SUCCESS(text))

    def _deploy(self, options: dict[str, Any]) -> None:
        version = _version(options["version"])
        services.adapter_version_deploy(version=version, actor=operator_actor(), reason=options["reason"],
                                        dry_run=options["dry_run"])
        self._done(options, f"{version.qualified_name} is the active version.")

    def _canary(self, options: dict[str, Any]) -> None:
        version = _version(options["version"])
        weight = _weight(options["weight"])
        actor, reason, dry_run = operator_actor(), options["reason"], options["dry_run"]
        if version.status == AdapterVersion.Status.CANARY:
            services.adapter_canary_set_weight(adapter=version.adapter, weight=weight, actor=actor, reason=reason,
                                               dry_run=dry_run)
        else:
            services.adapter_canary_start(version=version, weight=weight, actor=actor, reason=reason, dry_run=dry_run)
        self._done(options, f"{version.qualified_name} is the canary, at {weight:.0%} of the traffic.")

    def _promote(self, options: dict[str, Any]) -> None:
        adapter = _adapter(options["adapter"])
        canary = services.adapter_canary_promote(adapter=adapter, actor=operator_actor(), reason=options["reason"],
                                                 dry_run=options["dry_run"])
        self._done(options, f"{canary.qualified_name} is promoted to the active version.")

    def _abort(self, options: dict[str, Any]) -> None:
        adapter = _adapter(options["adapter"])
        canary = services.adapter_canary_abort(adapter=adapter, actor=operator_actor(), reason=options["reason"],
                                               dry_run=options["dry_run"])
        self._done(options, f"The canary {canary.qualified_name} is aborted; the active version takes all traffic.")

    def _rollback(self, options: dict[str, Any]) -> None:
        name, _, version = options["adapter"].partition("@")
        adapter = _adapter(name)
        target = services.adapter_rollback(adapter=adapter, actor=operator_actor(), version=version or None,
                                           reason=options["reason"], dry_run=options["dry_run"])
        self._done(options, f"Rolled back: {target.qualified_name} is the active version.")


def _adapter(text: str) -> Adapter:
    """The adapter `<tenant>/<adapter>` names."""
    tenant_slug, slash, name = text.partition("/")
    if not slash or not tenant_slug or not name or "@" in name:
        raise CommandError(f"{text!r}: name an adapter as <tenant>/<adapter>, e.g. acme/support-bot.")
    tenant = Tenant.objects.filter(slug=tenant_slug).first()
    if tenant is None:
        raise CommandError(f"No tenant '{tenant_slug}'.")
    return selectors.adapter_get(tenant=tenant, name=name)


def _version(text: str) -> AdapterVersion:
    """The version `<tenant>/<adapter>@<version>` names."""
    try:
        parts = parse_qualified_name(text)
    except ValueError as error:
        raise CommandError(f"{text!r}: name a version as <tenant>/<adapter>@<version>, e.g. acme/support-bot@1.2.0 "
                           f"({error}).") from None
    adapter = _adapter(f"{parts.tenant}/{parts.adapter}")
    return selectors.adapter_version_get(adapter=adapter, version=parts.version)


def _weight(text: str) -> float:
    """A share of traffic as typed: `10%` or `0.1` (the services check the range)."""
    percent = text.strip().endswith("%")
    try:
        value = float(text.strip().rstrip("%"))
    except ValueError:
        raise CommandError(f"--weight {text!r}: give a share of the traffic, 10% or 0.1.") from None
    if not percent and value > 1:
        raise CommandError(f"--weight {text}: a share is from 0 to 1 (or a percentage: {text}%).")
    return value / 100 if percent else value
