"""`python manage.py tenants …`: the operator's tenant commands (docs/keys.md, "From the command line").

create, list, suspend, activate; set-tier; create-key, keys, update-key, revoke-key. Each goes
through tenants.services, as the REST API and the dashboard do; changes of keys and tiers are
audited with the operator's login name (`operator:<user>`) and the `--reason` given.
"""

from __future__ import annotations

import re
from argparse import ArgumentParser
from collections.abc import Sequence
from datetime import UTC, datetime, time, timedelta
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from serving.contracts.errors import ServiceError
from tenants import selectors, services
from tenants.models import ApiKey

CLEAR = "none"
_RELATIVE = re.compile(r"^(\d+)([dhm])$")
_UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def _when(text: str) -> datetime | None:
    """An expiry as typed: `none`, `30d` / `12h` / `45m` from now, an ISO date (midnight UTC) or time."""
    if text.lower() == CLEAR:
        return None
    relative = _RELATIVE.match(text)
    if relative:
        return timezone.now() + timedelta(**{_UNITS[relative.group(2)]: int(relative.group(1))})
    try:
        moment = parse_datetime(text)
        day = None if moment else parse_date(text)
    except ValueError:
        moment = day = None
    if moment is not None:
        return moment if timezone.is_aware(moment) else moment.replace(tzinfo=UTC)
    if day is not None:
        return datetime.combine(day, time(), tzinfo=UTC)
    raise CommandError(f"--expires {text!r}: give a date (2027-01-31), a time (2027-01-31T18:00Z), a duration "
                       f"from now (30d, 12h, 45m) or '{CLEAR}'.")


def _number(option: str, text: str) -> int | None:
    if text.lower() == CLEAR:
        return None
    try:
        return int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise CommandError(f"{option} {text!r}: give a whole number, or '{CLEAR}' for no limit of the key's own.") \
            from None


def _controls(options: dict[str, Any]) -> dict[str, Any]:
    """The key controls the options name (an option not given changes nothing)."""
    controls: dict[str, Any] = {}
    if options["expires"] is not None:
        controls["expires_at"] = _when(options["expires"])
    if options["all_models"]:
        controls["allowed_models"] = []
    elif options["models"]:
        controls["allowed_models"] = [name.strip() for item in options["models"] for name in item.split(",")]
    for option, field in (("rpm", "requests_per_minute"), ("tpm", "tokens_per_minute"),
                          ("budget", "monthly_token_budget")):
        if options[option] is not None:
            controls[field] = _number(f"--{option}", options[option])
    return controls


def _describe(key: ApiKey) -> str:
    parts = [f"scopes {', '.join(key.scopes)}"]
    if key.expires_at:
        parts.append(f"expires {key.expires_at.isoformat(timespec='minutes')}")
    if key.allowed_models:
        parts.append(f"models {', '.join(key.allowed_models)}")
    for label, value in (("rpm", key.requests_per_minute), ("tpm", key.tokens_per_minute),
                         ("monthly budget", key.monthly_token_budget)):
        if value is not None:
            parts.append(f"{label} {value:,}")
    return "; ".join(parts)


class Command(BaseCommand):
    help = ("Create, list, suspend and activate tenants, change their tier; create, list, limit and revoke their "
            "API keys.")

    def add_arguments(self, parser: ArgumentParser) -> None:
        actions = "{create,list,suspend,activate,set-tier,create-key,keys,update-key,revoke-key}"
        commands = parser.add_subparsers(dest="action", required=True, metavar=actions)
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
        set_tier = commands.add_parser("set-tier", help="Move a tenant to another tier (quotas, priority); audited.")
        set_tier.add_argument("slug")
        set_tier.add_argument("tier", help="a tier name: vip, standard, batch, …")
        set_tier.add_argument("--reason", default="", help="why; kept in the tenant's audit log")

        create_key = commands.add_parser("create-key", help="Print a new API key for a tenant (shown once).")
        create_key.add_argument("slug")
        create_key.add_argument("--name", required=True, help="what the key is for, e.g. laptop or ci")
        create_key.add_argument("--scope", action="append", dest="scopes", choices=ApiKey.Scope.values,
                                help="repeat for several; default: inference and manage")
        self._control_arguments(create_key)
        keys = commands.add_parser("keys", help="List a tenant's API keys with their prefixes and limits.")
        keys.add_argument("slug")
        update_key = commands.add_parser("update-key", help="Change a key's expiry, models, rpm, tpm or budget.")
        update_key.add_argument("key", help="the key's prefix (lp-3f9a01c2…, as `keys` lists it)")
        self._control_arguments(update_key)
        update_key.add_argument("--all-models", action="store_true", help="clear the allow-list (every model)")
        revoke_key = commands.add_parser("revoke-key", help="Revoke an API key: it gets 401 from now on.")
        revoke_key.add_argument("key", help="the key's prefix (lp-3f9a01c2…, as `keys` lists it)")
        revoke_key.add_argument("--reason", default="", help="why; kept in the tenant's audit log")

    @staticmethod
    def _control_arguments(parser: ArgumentParser) -> None:
        parser.add_argument("--expires", help=f"30d, 12h, 2027-01-31 or 2027-01-31T18:00Z ('{CLEAR}': never)")
        parser.add_argument("--model", action="append", dest="models",
                            help="a model the key may call (adapter, adapter@version, the base model); repeat or "
                                 "separate with commas; none given: every model of the tenant")
        parser.add_argument("--rpm", help=f"the key's own requests per minute, at most the tier's ('{CLEAR}'); its "
                            "bucket holds GATEWAY_BUCKET_BURST minutes of it (2: --rpm 3 admits 6 at once)")
        parser.add_argument("--tpm", help=f"the key's own tokens per minute, at most the tier's ('{CLEAR}')")
        parser.add_argument("--budget", help=f"tokens per calendar month (UTC) ('{CLEAR}': unlimited)")
        parser.add_argument("--reason", default="", help="why; kept in the tenant's audit log")

    def handle(self, *args: Any, **options: Any) -> None:
        options.setdefault("all_models", False)
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

    def _table(self, header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> None:
        """Columns padded to their widths; the last column is left as it is."""
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
        for row in [header, *rows]:
            self.stdout.write("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])

    def _list(self, options: dict[str, Any]) -> None:
        rows = [(t.slug, t.tier.name, t.status, str(t.active_key_count), t.name) for t in selectors.tenant_list()]
        if not rows:
            self.stdout.write("No tenants yet. Create one: manage.py tenants create <slug> --tier standard")
            return
        self._table(("SLUG", "TIER", "STATUS", "KEYS", "NAME"), rows)

    def _suspend(self, options: dict[str, Any]) -> None:
        tenant = services.tenant_suspend(slug=options["slug"])
        self.stdout.write(self.style.SUCCESS(f"Suspended tenant '{tenant.slug}': its keys and sessions now get 403."))

    def _activate(self, options: dict[str, Any]) -> None:
        tenant = services.tenant_activate(slug=options["slug"])
        self.stdout.write(self.style.SUCCESS(f"Activated tenant '{tenant.slug}'."))

    def _set_tier(self, options: dict[str, Any]) -> None:
        tenant = services.tenant_set_tier(slug=options["slug"], tier_name=options["tier"],
                                          actor=services.operator_actor(), reason=options["reason"])
        tier = tenant.tier
        self.stdout.write(self.style.SUCCESS(
            f"Tenant '{tenant.slug}' is on the '{tier.name}' tier: {tier.requests_per_minute} requests and "
            f"{tier.tokens_per_minute:,} tokens per minute, {tier.max_tokens_per_request} tokens per request."))
        for key in selectors.api_keys_above_tier(tenant=tenant):
            self.stdout.write(self.style.WARNING(
                f"Key lp-{key.prefix}… ({key.name}) has limits above the new tier's ({_describe(key)}); the tier's "
                "apply. Lower them with update-key."))

    def _create_key(self, options: dict[str, Any]) -> None:
        tenant = selectors.tenant_by_slug(options["slug"])
        key, full_key = services.api_key_create(tenant=tenant, name=options["name"], scopes=options["scopes"],
                                                controls=_controls(options), actor=services.operator_actor(),
                                                reason=options["reason"])
        self.stdout.write(self.style.SUCCESS(
            f"Created API key '{key.name}' (lp-{key.prefix}…; {_describe(key)}) for tenant '{tenant.slug}'."))
        self.stdout.write("The key (shown once; store it now):")
        self.stdout.write(full_key)

    def _keys(self, options: dict[str, Any]) -> None:
        tenant = selectors.tenant_by_slug(options["slug"])
        now = timezone.now()

        def state(key: ApiKey) -> str:
            if key.revoked_at:
                return f"revoked {key.revoked_at:%Y-%m-%d}"
            return "expired" if key.is_expired(now) else "active"

        rows = [(f"lp-{key.prefix}…", key.name, state(key), _describe(key))
                for key in selectors.api_key_list(tenant=tenant)]
        if not rows:
            self.stdout.write(f"Tenant '{tenant.slug}' has no API keys. Create one: manage.py tenants create-key "
                              f"{tenant.slug} --name <what it is for>")
            return
        self._table(("KEY", "NAME", "STATE", "LIMITS"), rows)

    def _update_key(self, options: dict[str, Any]) -> None:
        controls = _controls(options)
        if not controls:
            raise CommandError("Nothing to change: give --expires, --model, --all-models, --rpm, --tpm or --budget.")
        key = services.api_key_update(api_key=selectors.api_key_by_prefix(options["key"]), controls=controls,
                                      actor=services.operator_actor(), reason=options["reason"])
        self.stdout.write(self.style.SUCCESS(f"API key lp-{key.prefix}… ({key.name}): {_describe(key)}."))

    def _revoke_key(self, options: dict[str, Any]) -> None:
        key = selectors.api_key_by_prefix(options["key"])
        was_live = key.revoked_at is None
        services.api_key_revoke(api_key=key, actor=services.operator_actor(), reason=options["reason"])
        if was_live:
            self.stdout.write(self.style.SUCCESS(
                f"Revoked API key lp-{key.prefix}… ({key.name}) of tenant '{key.tenant.slug}': it gets 401 from now on."))
        else:
            self.stdout.write(f"API key lp-{key.prefix}… ({key.name}) was already revoked on "
                              f"{key.revoked_at:%Y-%m-%d %H:%M}; nothing changed.")
