"""Policy settings read from the environment: one pydantic model style for every policy.

Each policy (runtime.breakers.BreakerConfig, runtime.redis_guard.RedisGuardConfig, the
gateway's canary, outlier, shedding, prewarm and routing configs, serving.gateway.config's
GatewayConfig, nested together in serving.gateway.config.GatewaySettings) is an `EnvModel`: a frozen
pydantic model whose fields each name their variable (`env(default, "GATEWAY_X")`), so a default
and its variable are written once, as the field. runtime.settings.PlatformSettings (a
pydantic-settings BaseSettings) reads the environment over `.env` once and hands it to
`from_environ`; the serving worker calls the same `from_environ`, so no variable is mapped twice.

An unset or empty variable means the field's default; anything else must parse, or the process
refuses to start with a message naming the variable and what it holds. `variables()` lists every
variable and its default: tests/gateway/test_config.py holds .env.example to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Self

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError

# What a value of the wrong shape must be, in the words of an operator's error message.
_EXPECTED = {"int_parsing": "an integer", "int_from_float": "an integer", "int_type": "an integer",
             "float_parsing": "a number", "float_type": "a number", "bool_parsing": "true or false"}


def env(default: Any, name: str, *fallbacks: str, description: str | None = None) -> Any:
    """A field read from the variable `name` (else the first set of `fallbacks`), `default` when unset."""
    return Field(default, validation_alias=AliasChoices(name, *fallbacks), description=description)


class EnvModel(BaseModel):
    """A policy's settings: fields made with `env`, nested EnvModels read from the same environment."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Self:
        """This model from `environ`; a value that does not parse raises ValueError naming its variable."""
        data: dict[str, Any] = {}
        used: dict[str, str] = {}
        for field, info in cls.model_fields.items():
            nested = info.annotation
            if isinstance(nested, type) and issubclass(nested, EnvModel):
                data[field] = nested.from_environ(environ)
                continue
            for name in _names(info.validation_alias):
                value = (environ.get(name) or "").strip()
                if value:
                    data[field], used[field] = value, name
                    break
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise ValueError(_explained(error, {name: data[field] for field, name in used.items()}, used)) from None

    @classmethod
    def variables(cls) -> Iterator[tuple[str, Any]]:
        """(variable, default) of every field, nested models' included, in field order (fallbacks left out)."""
        for field, info in cls.model_fields.items():
            nested = info.annotation
            if isinstance(nested, type) and issubclass(nested, EnvModel):
                yield from nested.variables()
            else:
                for name in _names(info.validation_alias)[:1]:
                    yield name, info.default


def _names(alias: Any) -> list[str]:
    if isinstance(alias, AliasChoices):
        return [str(choice) for choice in alias.choices]
    return [alias] if isinstance(alias, str) else []


def _explained(error: ValidationError, given: Mapping[str, str], used: Mapping[str, str]) -> str:
    """The first problem, named by its variable; one across fields (a model check) names those set."""
    problem = error.errors()[0]
    field = str(problem["loc"][0]) if problem["loc"] else ""
    name = used.get(field, field) or ", ".join(f"{key}={value}" for key, value in given.items())
    if problem["type"] in _EXPECTED:
        return f"{name} must be {_EXPECTED[problem['type']]}, got {problem['input']!r}"
    if problem["type"] == "literal_error":
        choices = problem.get("ctx", {}).get("expected", "").replace("'", "").replace(" or ", ", ")
        return f"{name} must be one of {choices}, got {problem['input']!r}"
    message = str(problem["msg"]).removeprefix("Value error, ")
    return f"{name}: {message}" if name else message
