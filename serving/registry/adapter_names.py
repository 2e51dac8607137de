"""The rules for a new adapter's name and for the tier's room for it, which the registry
(serving.registry.services) and training (a job's new adapter) both apply before creating anything."""

from __future__ import annotations

import re
from collections.abc import Callable

from serving.registry import selectors
from serving.registry.models import ADAPTER_NAME_PATTERN, Adapter
from serving.contracts.errors import InvalidInput, LimitExceeded
from tenants.models import Tenant

_NAME_RE = re.compile(rf"^{ADAPTER_NAME_PATTERN}$")


def adapter_name_validate(name: object, *, param: str = "name") -> str:
    """The rule for a new adapter's name, for the registry and for training jobs (InvalidInput)."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidInput(
            f"Invalid adapter name {name!r}: use 1–63 lowercase letters, digits, '-' or '_', starting and "
            "ending with a letter or digit (it becomes the `model` of requests, e.g. 'support-bot').",
            code="invalid_adapter_name", param=param,
        )
    if name in selectors.accepted_base_models():
        raise InvalidInput(f"'{name}' is the base model's name; an adapter needs a name of its own.",
                           code="invalid_adapter_name", param=param)
    return name


# Queries of the adapter names held for adapters a tenant does not have yet but that something will
# create (an active training job's new adapter): {name: who holds it}. Training registers its own
# (training.apps), so the registry counts those names against the tier's limit without importing it.
_name_holds: list[Callable[[Tenant], dict[str, str]]] = []


def adapter_name_holds_register(holds: Callable[[Tenant], dict[str, str]]) -> None:
    """Registers a query of the names a tenant's adapters-to-be hold, each with its holder."""
    if holds not in _name_holds:
        _name_holds.append(holds)


def adapter_names_held(*, tenant: Tenant) -> dict[str, str]:
    """The names held for the tenant's adapters-to-be, each with its (first) holder; not yet adapters."""
    held: dict[str, str] = {}
    for holds in _name_holds:
        for name, holder in holds(tenant).items():
            held.setdefault(name, holder)
    existing = set(Adapter.objects.filter(tenant=tenant, name__in=held).values_list("name", flat=True))
    return {name: holder for name, holder in held.items() if name not in existing}


def adapter_room_check(*, tenant: Tenant, name: str, param: str | None = None) -> None:
    """LimitExceeded when the tenant's tier has no room for a new adapter `name`.

    Its adapters count, and so do the names held for adapters to be (adapter_names_held) other than
    `name` itself: a training job holds its new adapter's room from its creation on, so it never
    fails at publishing for want of it. Exact when the caller holds the tenant's row lock (adapter
    creation, registration and training job creation do).
    """
    count = Adapter.objects.filter(tenant=tenant).count()
    held = {other: holder for other, holder in adapter_names_held(tenant=tenant).items() if other != name}
    limit = tenant.tier.max_adapters
    if count + len(held) >= limit:
        holding = ""
        if held:
            names = ", ".join(f"'{other}' ({holder})" for other, holder in sorted(held.items()))
            holding = f" and {len(held)} more name(s) held for adapters to be: {names}"
        raise LimitExceeded(
            f"Tenant '{tenant.slug}' has {count} adapters{holding}, the most its tier '{tenant.tier.name}' allows "
            f"({limit}); delete an adapter or move to a higher tier.", code="max_adapters_reached", param=param,
        )
