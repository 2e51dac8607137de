"""`python manage.py tenants create|list|suspend|activate`: the operator's tenant commands."""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from serving.wire.errors import ServiceError
from tenants import selectors, services
from tenants.models import ApiKey


class Command(BaseCommand):
    help = "Create, list, suspend and activate tenants; create API keys."

    def add_arguments(self, parser: ArgumentParser) -> None:
        commands = parser.add_subparsers(dest="action", required=True, metavar="{create,list,suspend,activate,create-key}")
        create = commands.add_parser("create", help="Create a tenant and print its first API key (shown once).")
        create.add_argument("slug", help="lowercase letters, digits and hyphens, e.g. acme")
        create.add_argument("--tier", required=True, help="a tier name: vip, standard, batch, …")
        create.add_argument("--name", help="display name (default: the slug)")
        create.add_argument("--owner-email", help="make this user (created if missing) the tenant's owner")
        commands.add_parser("list", help="List tenants with their tier, status and active key count.")
        suspend = commands.add_parser("suspend", help="Refuse the tenant's API keys and sessions (403).")
        suspend.add_argument("slug")
        activate = commands.add_parser("activate", help="Let a suspended tenant in again.")
        activate.add_argument("slug")
        create_key = commands.add_parser("create-key", help="Print a new API key for a tenant (shown once).")
        create_key.add_argument("slug")
        create_key.add_argument("--name", required=True, help="what the key is for, e.g. laptop or ci")
        create_key.add_argument("--scope", action="append", dest="scopes", choices=ApiKey.Scope.values,
                                help="repeat for several; default: inference and manage")

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            getattr(self, f"_{options['action'].replace('-', '_')}")(options)
        except ServiceError as error:
            raise CommandError(error.message) from error

    def _create(self, options: dict[str, Any]) -> None:
        tenant, key = services.tenant_create(
            slug=options["slug"], tier_name=options["tier"], name=options["name"], owner_email=options["owner_email"]
        )
        self.stdout.write(self.style.SUCCESS(f"Created tenant '{tenant.slug}' on tier '{tenant.tier.name}'."))
        if options["owner_email"]:
            self.stdout.write(f"Owner: {options['owner_email']} (set a password in the admin to log in).")
        self.stdout.write("Its first API key (shown once; store it now):")
        self.stdout.write(key)

    def _list(self, options: dict[str, Any]) -> None:
        rows = [(t.slug, t.tier.name, t.status, str(t.active_key_count), t.name) for t in selectors.tenant_list()]
        if not rows:
            self.stdout.write("No tenants yet. Create one: manage.py tenants create <slug> --tier standard")
            return
        header = ("SLUG", "TIER", "STATUS", "KEYS", "NAME")
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
        for row in [header, *rows]:
            self.stdout.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])

    def _suspend(self, options: dict[str, Any]) -> None:
        tenant = services.tenant_suspend(slug=options["slug"])
        self.stdout.write(self.style.SUCCESS(f"Suspended tenant '{tenant.slug}': its keys and sessions now get 403."))

    def _activate(self, options: dict[str, Any]) -> None:
        tenant = services.tenant_activate(slug=options["slug"])
        self.stdout.write(self.style.SUCCESS(f"Activated tenant '{tenant.slug}'."))

    def _create_key(self, options: dict[str, Any]) -> None:
        tenant = selectors.tenant_by_slug(options["slug"])
        key, full_key = services.api_key_create(tenant=tenant, name=options["name"], scopes=options["scopes"])
        self.stdout.write(self.style.SUCCESS(
            f"Created API key '{key.name}' ({', '.join(key.scopes)}) for tenant '{tenant.slug}'."))
        self.stdout.write("The key (shown once; store it now):")
        self.stdout.write(full_key)
