"""One config path (docs/gateway.md, "Configuration"): each policy's model (runtime.env.EnvModel)
reads its own GATEWAY_* variables (`from_environ`), each default written once, as its field's;
GatewaySettings nests them; the settings hold the instances; .env.example documents every variable
with that default, and no variable the models do not define."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from serving.gateway.canary_rule import CanaryRuleConfig
from serving.gateway.config import GatewayConfig, GatewaySettings
from serving.gateway.outliers import OutlierConfig
from serving.gateway.prewarm import PrewarmConfig
from serving.gateway.prewarm_loop import PrewarmLoopConfig
from serving.gateway.routing import RoutingConfig
from serving.gateway.shedding import ShedConfig
from runtime.breakers import BreakerConfig
from runtime.redis_guard import RedisGuardConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [GatewayConfig, RoutingConfig, BreakerConfig, CanaryRuleConfig, OutlierConfig, ShedConfig, RedisGuardConfig,
           PrewarmConfig, PrewarmLoopConfig]
SETTINGS = {"GATEWAY": GatewayConfig, "GATEWAY_ROUTING": RoutingConfig, "GATEWAY_BREAKERS": BreakerConfig,
            "GATEWAY_CANARY_ABORT": CanaryRuleConfig, "GATEWAY_OUTLIERS": OutlierConfig,
            "GATEWAY_SHEDDING": ShedConfig, "GATEWAY_REDIS": RedisGuardConfig, "GATEWAY_PREWARM": PrewarmConfig,
            "GATEWAY_PREWARM_LOOP": PrewarmLoopConfig}


class Recording(Mapping[str, str]):
    """An environment that remembers which variables were asked for."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values, self.asked = values, set[str]()

    def __getitem__(self, name: str) -> str:
        self.asked.add(name)
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def get(self, name: str, default: object = None):  # type: ignore[override]
        self.asked.add(name)
        return self.values.get(name, default)


def _documented() -> dict[str, str]:
    """NAME=value of every GATEWAY_* line of .env.example, commented out or not."""
    text = (ROOT / ".env.example").read_text()
    return dict(re.findall(r"^#? ?(GATEWAY_[A-Z_]+)=(\S*)$", text, re.MULTILINE))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_variable_is_documented_with_the_model_default(config) -> None:
    documented = _documented()
    environ = Recording(documented)
    assert config.from_environ(environ) == config(), ".env.example's values are the fields' defaults"
    read = {name for name in environ.asked if name.startswith("GATEWAY_")}
    assert read and read <= documented.keys(), f"undocumented: {sorted(read - documented.keys())}"
    assert config.from_environ({}) == config()


def test_env_example_lists_exactly_the_gateway_settings_variables_with_their_defaults() -> None:
    defined = dict(GatewaySettings.variables())
    documented = _documented()
    assert sorted(documented) == sorted(defined), "a GATEWAY_* line of .env.example for each field, no other"
    for name, default in defined.items():
        assert type(default)(documented[name]) == default, name
    assert GatewaySettings.from_environ(documented) == GatewaySettings()


def test_a_variable_overrides_its_field_and_a_bad_value_names_the_variable() -> None:
    assert BreakerConfig.from_environ({"GATEWAY_BREAKER_WINDOW": "20", "GATEWAY_BREAKER_MINIMUM_CALLS": "10"}) == \
        BreakerConfig(window_size=20, minimum_calls=10)
    assert PrewarmLoopConfig.from_environ({"GATEWAY_PREWARM_MIN_PER_HOUR": "36"}).min_rate == pytest.approx(0.01)
    assert GatewayConfig.from_environ({"WEB_CONCURRENCY": "4"}).processes == 4
    assert GatewayConfig.from_environ({"WEB_CONCURRENCY": "4", "GATEWAY_PROCESSES": "2"}).processes == 2
    assert ShedConfig.from_environ({"GATEWAY_SHED_RETRY_AFTER": ""}) == ShedConfig(), "empty is the default"
    with pytest.raises(ValueError, match="GATEWAY_OUTLIER_CONSECUTIVE_FAILURES must be an integer, got 'five'"):
        OutlierConfig.from_environ({"GATEWAY_OUTLIER_CONSECUTIVE_FAILURES": "five"})
    with pytest.raises(ValueError, match="GATEWAY_REDIS_TIMEOUT must be a number, got '1s'"):
        RedisGuardConfig.from_environ({"GATEWAY_REDIS_TIMEOUT": "1s"})
    with pytest.raises(ValueError, match="GATEWAY_BREAKER_MINIMUM_CALLS.*minimum_calls must be within 1 and window_size"):
        GatewaySettings.from_environ({"GATEWAY_BREAKER_MINIMUM_CALLS": "500"})


def test_the_nested_settings_read_each_policy_from_the_one_environment() -> None:
    read = GatewaySettings.from_environ({"GATEWAY_SHED_QUEUE_FRACTION": "0.25", "GATEWAY_WEIGHT_KV": "3",
                                         "GATEWAY_PREWARM_TAU_SECONDS": " 60 ", "WEB_CONCURRENCY": "3"})
    assert read.shedding == ShedConfig(queue_fraction=0.25)
    assert read.routing.weights.kv == 3.0
    assert read.prewarm.tau_s == 60.0
    assert read.gateway.processes == 3
    assert read.breakers == BreakerConfig()


def test_the_settings_hold_one_instance_per_policy(settings) -> None:
    for name, config in SETTINGS.items():
        assert isinstance(getattr(settings, name), config), name
    assert not [name for name in dir(settings) if re.fullmatch(r"GATEWAY_(BREAKER|OUTLIER|SHED|PREWARM)_[A-Z_]+", name)]
