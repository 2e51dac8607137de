"""The platform's typed settings (runtime.settings): the environment over `.env` over the
defaults, one parse per variable (the GATEWAY_BREAKER_* ones included), errors that name the
variable, and what a deployment must refuse."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.breakers import BreakerConfig
from runtime.settings import (
    DEFAULT_SECRET_KEY,
    ENV_FILE_VARIABLE,
    PROJECT_DIR,
    SettingsError,
    env_file_path,
    is_local_host,
    settings_read,
)

# What the suite's environment sets (tests/suite_env.py) and these tests choose themselves.
OWN = ("DJANGO_DEBUG", "DJANGO_SECRET_KEY", "DJANGO_ALLOWED_HOSTS", "LOG_LEVEL", "LOG_FORMAT", "STORAGE_URL",
       "LORAPLEX_VAR_DIR", "BASE_MODEL_PATH", "BASE_MODEL_NAME", "REGISTRY_TOKEN", "SERVING_WORKER_API_KEY",
       "LORAPLEX_WEB_PORT", "LOGIN_FAILURES_PER_ACCOUNT", "GATEWAY_BREAKER_WINDOW", "GATEWAY_BREAKER_MINIMUM_CALLS")


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OWN:
        monkeypatch.delenv(name, raising=False)


def test_defaults_are_production_and_json() -> None:
    settings = settings_read(None)
    assert settings.django_debug is False and settings.log_format == "json"
    assert settings.storage_url == f"file://{PROJECT_DIR / 'var' / 'storage'}"
    assert settings.base_model_name == "tiny-llama" and settings.breakers == BreakerConfig()


def test_env_file_values_are_read_and_the_environment_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("DJANGO_DEBUG=true\nLOG_LEVEL=debug\nDJANGO_ALLOWED_HOSTS=a.example, b.example\n"
                        f"LORAPLEX_VAR_DIR={tmp_path / 'var'}\nGATEWAY_BREAKER_WINDOW=20\n"
                        "GATEWAY_BREAKER_MINIMUM_CALLS=10\nLOG_FORMAT=text\n")
    monkeypatch.setenv("LOG_FORMAT", "json")
    monkeypatch.setenv("GATEWAY_BREAKER_MINIMUM_CALLS", "5")
    settings = settings_read(env_file)
    assert settings.django_debug is True and settings.log_level == "DEBUG"
    assert settings.django_allowed_hosts == ["a.example", "b.example"]
    assert settings.storage_url == f"file://{tmp_path / 'var' / 'storage'}", "defaults follow the file's values"
    assert settings.log_format == "json", "the environment wins over .env"
    # The policies that parse their own variables see .env too, under the environment.
    assert (settings.breakers.window_size, settings.breakers.minimum_calls) == (20, 5)
    assert settings.environ["GATEWAY_BREAKER_WINDOW"] == "20"


def test_an_empty_variable_is_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DJANGO_ALLOWED_HOSTS", "")
    monkeypatch.setenv("REGISTRY_TOKEN", "")
    settings = settings_read(None)
    assert settings.django_allowed_hosts == ["localhost", "127.0.0.1", "[::1]", "testserver"]
    assert settings.registry_token == ""


def test_which_env_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(ENV_FILE_VARIABLE)
    assert env_file_path() == PROJECT_DIR / ".env"
    monkeypatch.setenv(ENV_FILE_VARIABLE, str(tmp_path / "prod.env"))
    assert env_file_path() == tmp_path / "prod.env"
    monkeypatch.setenv(ENV_FILE_VARIABLE, "")
    assert env_file_path() is None
    assert settings_read(tmp_path / "absent.env").django_debug is False, "a file that is not there is no file"


def test_values_that_do_not_parse_name_their_variable_and_hide_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DJANGO_DEBUG", "maybe")
    monkeypatch.setenv("LORAPLEX_WEB_PORT", "80000")
    monkeypatch.setenv("LOG_FORMAT", "yaml")
    with pytest.raises(SettingsError) as raised:
        settings_read(None)
    message = str(raised.value)
    assert "DJANGO_DEBUG: Input should be a valid boolean" in message and "'maybe'" in message
    assert "LORAPLEX_WEB_PORT: Input should be less than or equal to 65535" in message
    assert "LOG_FORMAT: Input should be 'text' or 'json'" in message
    assert "default factory" not in message, "no echo of the defaults made from a failed field"
    monkeypatch.delenv("DJANGO_DEBUG")
    monkeypatch.delenv("LORAPLEX_WEB_PORT")
    monkeypatch.delenv("LOG_FORMAT")
    monkeypatch.setenv("SERVING_WORKER_API_KEY", "")
    monkeypatch.setenv("LOGIN_FAILURES_PER_ACCOUNT", "0")
    with pytest.raises(SettingsError, match=r"LOGIN_FAILURES_PER_ACCOUNT: Input should be greater than or equal to 1"):
        settings_read(None)


def test_the_secret_fields_stay_out_of_the_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DJANGO_SECRET_KEY", "s3cr3t-value")
    monkeypatch.setenv("SERVING_WORKER_API_KEY", "worker-k3y")
    shown = repr(settings_read(None))
    assert "s3cr3t-value" not in shown and "worker-k3y" not in shown


@pytest.mark.parametrize(("environment", "refused"), [
    ({}, ["DJANGO_SECRET_KEY is the development default"]),
    ({"DJANGO_SECRET_KEY": "own"}, []),
    ({"DJANGO_DEBUG": "true"}, []),
    ({"DJANGO_DEBUG": "true", "DJANGO_ALLOWED_HOSTS": "localhost,api.localhost,127.0.0.2,[::1]"}, []),
    ({"DJANGO_DEBUG": "true", "DJANGO_ALLOWED_HOSTS": "localhost,loraplex.example.com"},
     ["DJANGO_DEBUG is true while DJANGO_ALLOWED_HOSTS names hosts others can reach (loraplex.example.com)"]),
    ({"DJANGO_SECRET_KEY": "own", "DJANGO_ALLOWED_HOSTS": "*"}, ["DJANGO_ALLOWED_HOSTS contains '*'"]),
    ({"DJANGO_DEBUG": "true", "DJANGO_ALLOWED_HOSTS": "*"}, ["DJANGO_ALLOWED_HOSTS contains '*'"]),
    ({"DJANGO_ALLOWED_HOSTS": "*,10.0.0.7"}, ["DJANGO_ALLOWED_HOSTS contains '*'",
                                               "DJANGO_SECRET_KEY is the development default"]),
])
def test_what_a_deployment_refuses(monkeypatch: pytest.MonkeyPatch, environment: dict[str, str],
                                   refused: list[str]) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    reasons = settings_read(None).unsafe_for_deployment()
    assert len(reasons) == len(refused)
    for reason, start in zip(reasons, refused):
        assert reason.startswith(start)


def test_local_hosts() -> None:
    assert all(map(is_local_host, ["localhost", "LOCALHOST", "x.localhost", ".localhost", "127.0.0.1", "127.1.2.3",
                                   "[::1]", "::1", "testserver", "localhost."]))
    assert not any(map(is_local_host, ["example.com", ".example.com", "10.0.0.1", "192.168.1.2", "0.0.0.0",
                                       "localhost.example.com", "[2001:db8::1]"]))
    assert DEFAULT_SECRET_KEY.startswith("loraplex-insecure")


def test_the_project_directory_is_the_checkouts_root() -> None:
    """var/, .env and the templates are found from it: a module moved one level up or down must move it too."""
    assert PROJECT_DIR == Path(__file__).resolve().parents[2]
    assert (PROJECT_DIR / "manage.py").is_file()


def test_secrets_are_read_from_their_files_where_the_variables_are_unset(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Compose's setup generates the key and the token into a volume (docker-compose.yml) and
    points DJANGO_SECRET_KEY_FILE and REGISTRY_TOKEN_FILE at them: every process reads them there,
    one under `docker compose exec` too; the variables themselves win where set."""
    (tmp_path / "key").write_text("generated-key-0123456789\n")
    (tmp_path / "token").write_text("generated-token\n")
    monkeypatch.setenv("DJANGO_SECRET_KEY_FILE", str(tmp_path / "key"))
    monkeypatch.setenv("REGISTRY_TOKEN_FILE", str(tmp_path / "token"))
    read = settings_read(None)
    assert (read.django_secret_key, read.registry_token) == ("generated-key-0123456789", "generated-token")
    assert read.unsafe_for_deployment() == []
    monkeypatch.setenv("DJANGO_SECRET_KEY", "the-operators-own")
    assert settings_read(None).django_secret_key == "the-operators-own"


@pytest.mark.parametrize("content", [None, ""])
def test_a_secret_file_named_but_missing_or_empty_stops_the_process(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, content: str | None) -> None:
    """Never the development default in its place: a deployment whose setup did not run refuses to start."""
    if content is not None:
        (tmp_path / "key").write_text(content)
    monkeypatch.setenv("DJANGO_SECRET_KEY_FILE", str(tmp_path / "key"))
    with pytest.raises(SettingsError, match="DJANGO_SECRET_KEY_FILE names .*key, which "):
        settings_read(None)
