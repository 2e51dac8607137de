"""Reading a policy's settings from the environment: one reader for every `from_environ`.

Each policy dataclass (serving.wire.breakers.BreakerConfig, the gateway's canary, outlier, shedding,
prewarm and routing configs, serving.gateway.config.GatewayConfig) writes its defaults once, as
its fields', and reads its own variables with these helpers; the Django settings module holds the
instances and the serving worker calls the same `from_environ`, so no variable is mapped twice.

An unset or empty variable means the field's default; anything else must parse, or the process
refuses to start with a message naming the variable and what it holds.
"""

from __future__ import annotations

from collections.abc import Mapping


def env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    """`name` as an integer, `default` when unset or empty."""
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def env_float(environ: Mapping[str, str], name: str, default: float) -> float:
    """`name` as a number, `default` when unset or empty."""
    value = environ.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def env_choice(environ: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    """`name` as one of `choices` (compared lower-case), `default` when unset or empty."""
    value = environ.get(name, "").strip()
    if not value:
        return default
    if value.lower() not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value.lower()
