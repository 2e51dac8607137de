"""An API key's own controls (docs/keys.md): expiry, a model allow-list, rpm/tpm under the tier's,
a monthly token budget. The one place their values are checked (`controls_clean`, for every surface:
the REST API, the dashboard, `manage.py tenants`) and the allow-list is read (`model_allowed`, for
the gateway's catalog)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from django.utils import timezone

from serving.contracts.errors import InvalidInput
from tenants.models import Tier

CONTROL_FIELDS = ("expires_at", "allowed_models", "requests_per_minute", "tokens_per_minute", "monthly_token_budget")
MAX_ALLOWED_MODELS = 100
# A request's `model` is stored in at most 200 characters (serving.registry.models.UsageRecord.model).
MODEL_NAME_MAX_CHARS = 200
# A budget beyond this is no budget (and would overflow what a counter shows sensibly).
MAX_MONTHLY_TOKEN_BUDGET = 10**15


def model_allowed(allowed: Iterable[str], model: str, *, base_model_ids: Iterable[str]) -> bool:
    """Whether a key with the allow-list `allowed` may call `model` (a request's `model` field).

    An empty list allows every model of the tenant. An adapter's name allows the adapter and every
    pinned version of it (`support-bot` allows `support-bot@1.0.2`); a pinned name allows only that
    version; any name of the base model (its id or an alias) allows the base model by all its names.
    """
    allowed = tuple(allowed)
    if not allowed:
        return True
    base = set(base_model_ids)
    if model in base:
        return any(name in base for name in allowed)
    return model in allowed or model.partition("@")[0] in allowed


def _allowed_models(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise InvalidInput("allowed_models must be a list of model names (adapter names, 'adapter@version' pins or "
                           "the base model's name); an empty list allows every model of the tenant.",
                           code="invalid_allowed_models", param="allowed_models")
    names: list[str] = []
    for raw in value:
        name = raw.strip()
        if not name or len(name) > MODEL_NAME_MAX_CHARS or any(char.isspace() or char == "," for char in name):
            raise InvalidInput(f"allowed_models has {raw!r:.80}, which is no model name: a name has 1 to "
                               f"{MODEL_NAME_MAX_CHARS} characters without spaces or commas.",
                               code="invalid_allowed_models", param="allowed_models")
        if name.count("@") > 1:
            raise InvalidInput(f"allowed_models has '{name:.80}': a pinned name is 'adapter@version', with one '@'.",
                               code="invalid_allowed_models", param="allowed_models")
        if name not in names:
            names.append(name)
    if len(names) > MAX_ALLOWED_MODELS:
        raise InvalidInput(f"allowed_models names {len(names)} models; a key's list holds at most "
                           f"{MAX_ALLOWED_MODELS} (name an adapter to allow all its versions).",
                           code="invalid_allowed_models", param="allowed_models")
    return names


def _positive(name: str, value: Any, *, ceiling: int, ceiling_text: str, code: str, why: str = "") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be a whole number or null (no limit of its own), got {value!r:.40}.",
                           code="invalid_key_limit", param=name)
    if value < 1:
        raise InvalidInput(f"{name} must be at least 1; to stop a key, revoke it.", code="invalid_key_limit",
                           param=name)
    if value > ceiling:
        raise InvalidInput(f"{name} is {value}, above {ceiling_text} ({ceiling}){why}.", code=code, param=name)
    return value


def _expires_at(value: Any, now: datetime) -> datetime | None:
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidInput(f"expires_at must be a date and time (ISO 8601) or null, got {value!r:.40}.",
                           code="invalid_expiry", param="expires_at")
    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.get_current_timezone())
    if value <= now:
        raise InvalidInput(f"expires_at ({value.isoformat()}) is not in the future; to stop a key now, revoke it.",
                           code="invalid_expiry", param="expires_at")
    return value


def controls_clean(values: Mapping[str, Any], *, tier: Tier, now: datetime | None = None) -> dict[str, Any]:
    """The controls in `values` (any of CONTROL_FIELDS), checked and normalised; InvalidInput naming
    the first wrong one. rpm and tpm may not exceed the tier's (`tier`)."""
    unknown = sorted(set(values) - set(CONTROL_FIELDS))
    if unknown:
        raise InvalidInput(f"Unknown key control(s) {', '.join(unknown)}; the controls are "
                           f"{', '.join(CONTROL_FIELDS)}.", code="unknown_key_control", param=unknown[0])
    cleaners: dict[str, Any] = {
        "expires_at": lambda value: _expires_at(value, now or timezone.now()),
        "allowed_models": _allowed_models,
        "requests_per_minute": lambda value: _positive(
            "requests_per_minute", value, ceiling=tier.requests_per_minute,
            ceiling_text=f"the '{tier.name}' tier's requests per minute",
            code="key_limit_above_tier", why="; a key's limits can only be lower than its tier's"),
        "tokens_per_minute": lambda value: _positive(
            "tokens_per_minute", value, ceiling=tier.tokens_per_minute,
            ceiling_text=f"the '{tier.name}' tier's tokens per minute",
            code="key_limit_above_tier", why="; a key's limits can only be lower than its tier's"),
        "monthly_token_budget": lambda value: _positive(
            "monthly_token_budget", value, ceiling=MAX_MONTHLY_TOKEN_BUDGET,
            ceiling_text="the largest budget a key may have",
            code="invalid_key_limit"),
    }
    return {name: cleaners[name](value) for name, value in values.items()}
