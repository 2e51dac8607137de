"""`python manage.py registry export|import FILE`: the deployed state as YAML (see serving.registry_file)."""

from __future__ import annotations

import sys
from argparse import ArgumentParser
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from django.core.management.base import BaseCommand, CommandError

from serving.wire.errors import ServiceError
from serving.registry_file import registry_export, registry_import
from tenants.models import Tenant

ACTOR = "operator:registry-import"


class Command(BaseCommand):
    help = "Export the adapter registry to a YAML file, or restore the state a file describes."

    def add_arguments(self, parser: ArgumentParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True, metavar="{export,import}")
        export = actions.add_parser("export", help="Write every version with its status and traffic weight.")
        export.add_argument("file", help="where to write the YAML ('-' for standard output)")
        export.add_argument("--tenant", help="only this tenant's adapters (a slug)")
        restore = actions.add_parser("import", help="Register missing versions from their artifacts and bring "
                                                    "active versions, canaries and weights to the file's state.")
        restore.add_argument("file", help="a YAML file written by export (or in its shape; '-' for standard input)")
        restore.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            if options["action"] == "export":
                self._export(options)
            else:
                self._import(options)
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
