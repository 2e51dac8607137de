"""Django settings: Django's names for the platform's typed settings (runtime.settings), which
come from the environment and `.env`, with defaults that run on one machine.

The defaults are the embedded ones (SQLite under var/, an embedded Redis server, storage in a local
directory); `.env.example` lists every variable. Production sets DATABASE_URL, REDIS_URL and
STORAGE_URL to real services, and DJANGO_SECRET_KEY: outside DEBUG (DJANGO_DEBUG unset means false;
`make up` sets it) the process refuses to start on the development key, and in any mode on
ALLOWED_HOSTS=* or, under DEBUG, a host others can reach (docs/operations.md, "Settings").
"""

from __future__ import annotations

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from lora_platform.embedded_redis import celery_redis_url, redis_url_or_embedded
from serving.gateway.config import GatewaySettings
from runtime.logs import logging_config
from runtime.settings import PROJECT_DIR, platform_settings

# Lower case, so not a Django setting itself (settings pages and diffsettings would show its secrets).
platform = platform_settings()
_refusals = platform.unsafe_for_deployment()
if _refusals:
    raise ImproperlyConfigured("Loraplex refuses to start: " + " ".join(_refusals))

BASE_DIR = PROJECT_DIR
VAR_DIR = platform.loraplex_var_dir
VAR_DIR.mkdir(parents=True, exist_ok=True)

DEBUG = platform.django_debug
SECRET_KEY = platform.django_secret_key
ALLOWED_HOSTS = platform.django_allowed_hosts
CSRF_TRUSTED_ORIGINS = platform.django_csrf_trusted_origins

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
    "serving.registry",  # label "serving": its tables, migrations and permissions keep the name
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
    "default": dj_database_url.parse(platform.database_url, conn_max_age=platform.database_conn_max_age)
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
SERVE_STATIC = platform.serve_static
# Without collectstatic (development, tests) whitenoise finds files where the finders do.
WHITENOISE_USE_FINDERS = True
LOGIN_URL = "dashboard:login"
LOGIN_REDIRECT_URL = "dashboard:overview"
LOGOUT_REDIRECT_URL = "dashboard:login"

# Bodies above this are refused with 413 before a view reads them; uploads stream to storage
# through their own, larger limits (FILE_UPLOAD_* and the per-feature settings).
DATA_UPLOAD_MAX_MEMORY_SIZE = platform.data_upload_max_memory_size
FILE_UPLOAD_MAX_MEMORY_SIZE = platform.file_upload_max_memory_size
# Multipart uploads (datasets, adapters) stream to disk above FILE_UPLOAD_MAX_MEMORY_SIZE; this caps
# their total size. Per-feature limits (dataset bytes per tier, adapter bytes) are checked as well.
MAX_UPLOAD_BYTES = platform.max_upload_bytes
# The web server's connections (docs/web-server.md): seconds a request may take to send its headers
# (408 past it), seconds a request body may go without a byte (408 past it; 0: no limit), seconds
# an idle keep-alive connection is kept, connections one client address may hold at once (0: no
# cap). Read by lora_platform.asgi's HTTPProtocol.
WEB_HEADER_TIMEOUT_SECONDS = platform.web_header_timeout_seconds
WEB_BODY_TIMEOUT_SECONDS = platform.web_body_timeout_seconds
WEB_KEEP_ALIVE_SECONDS = platform.web_keep_alive_seconds
WEB_MAX_CONNECTIONS_PER_CLIENT = platform.web_max_connections_per_client

REDIS_URL = redis_url_or_embedded(platform.redis_url, VAR_DIR, persist=platform.loraplex_embedded_redis_persist)
# Seconds any Redis command (and connecting) may take before it fails: a frozen Redis must not stall
# requests that send tasks or read token buckets (redis-py's own default waits forever).
REDIS_SOCKET_TIMEOUT = platform.redis_socket_timeout
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
LOGIN_FAILURES_PER_ACCOUNT = platform.login_failures_per_account
LOGIN_FAILURES_PER_ADDRESS = platform.login_failures_per_address
LOGIN_FAILURE_WINDOW_SECONDS = platform.login_failure_window_seconds
STORAGE_URL = platform.storage_url
S3_ENDPOINT_URL = platform.s3_endpoint_url

# The shared base model: every adapter is trained on it and served on it.
# BASE_MODEL may name it by Hugging Face id: BASE_MODEL_PATH is then its snapshot in the hub cache
# (found there, or downloaded, as this process starts) and BASE_MODEL_REVISION its commit hash,
# recorded on jobs and versions ("" for a plain directory).
BASE_MODEL_PATH = platform.base_model_source.path
BASE_MODEL_REVISION = platform.base_model_source.revision or ""
BASE_MODEL_NAME = platform.base_model_name
# Extra base-model names accepted on uploaded adapters (e.g. the hub id the base was copied from).
BASE_MODEL_ALIASES = platform.base_model_aliases
MAX_LORA_RANK = platform.max_lora_rank
# An uploaded adapter's files, unpacked, may not exceed this (also bounds what an archive expands to).
ADAPTER_MAX_BYTES = platform.adapter_max_bytes
# Serving workers present this token to read the registry snapshot; empty disables that endpoint.
REGISTRY_TOKEN = platform.registry_token

# The public gateway (/v1, docs/gateway.md). The serving workers' shared API key: the gateway sends
# it on every call, and only callers holding it may have a worker load a registry version.
SERVING_WORKER_API_KEY = platform.serving_worker_api_key
# The gateway's settings: one nested model (serving.gateway.config.GatewaySettings; defaults and
# variable names in its policies' fields, .env.example lists them) read from the settings'
# environment (the environment over .env), one instance per policy named below: docs/gateway.md,
# "Configuration".
GATEWAY_SETTINGS = GatewaySettings.from_environ(platform.environ)
GATEWAY = GATEWAY_SETTINGS.gateway
GATEWAY_ROUTING = GATEWAY_SETTINGS.routing

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "tenants.authentication.ApiKeyAuthentication",
        "tenants.authentication.TenantSessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["tenants.permissions.HasTenant"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": [
        # DRF's, with the gateway's bound on nesting (a 100,000-deep body was a RecursionError's 500).
        "api.parsers.JSONParser",
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
    # drf-spectacular's own hook, then the gateway's routes, which are not DRF views (serving.gateway.openapi).
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "serving.gateway.openapi.gateway_paths"],
}

# Celery: long training tasks must survive a worker that dies mid-task, so a task is acknowledged
# only after it finishes, a lost worker puts it back on the queue, and a worker takes one at a time.
CELERY_BROKER_URL = platform.celery_broker_url or celery_redis_url(REDIS_URL)
CELERY_RESULT_BACKEND = platform.celery_result_backend or celery_redis_url(REDIS_URL)
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# Two queues, each with its own worker (the launcher's children, compose's services; docs/operations.md):
# `quick` for validation and the periodic repairs, `training` for training runs, so neither waits for
# the other (a training job used to hold a tenant's 17 KB validation for 14 minutes). Every task is
# routed by name (tests/lora_platform/test_celery_queues.py checks each has a route to a queue some
# worker consumes); Celery's own tasks fall to `quick`, never to an unconsumed `celery` queue.
CELERY_TASK_DEFAULT_QUEUE = "quick"
CELERY_TASK_ROUTES = {
    "training.tasks.dataset_validate": {"queue": "quick"},
    "training.tasks.training_jobs_sweep": {"queue": "quick"},
    "training.tasks.uploads_expire": {"queue": "quick"},
    "training.tasks.training_job_run": {"queue": "training"},
}
# A redelivered task must wait for the broker's visibility timeout; training jobs can run for
# hours, so the timeout is generous, and tests shorten it. Kombu 5.7 looks for overdue unacked
# tasks every `unacked_restore_interval` (10 s) times `unacked_restore_throttle` (10): a dead worker's
# task waited 100 s past its timeout. Throttle 1 looks every 10 s; a look is one sorted-set range.
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": platform.celery_visibility_timeout,
    "unacked_restore_throttle": 1,
    "socket_timeout": REDIS_SOCKET_TIMEOUT,
    "socket_connect_timeout": REDIS_SOCKET_TIMEOUT,
}
CELERY_REDIS_SOCKET_TIMEOUT = CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = REDIS_SOCKET_TIMEOUT
CELERY_BROKER_CONNECTION_TIMEOUT = REDIS_SOCKET_TIMEOUT
# Sending a task retries twice, not Celery's default three times, so a request waits at most a few
# socket timeouts for a broker that is down (the sweep sends what could not be sent).
CELERY_TASK_PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.2}
CELERY_RESULT_EXPIRES = 3600
CELERY_TASK_ALWAYS_EAGER = platform.celery_task_always_eager
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
# Periodic repairs, sent by `celery -A lora_platform beat`: room under a tenant's concurrent-job limit
# left without a follow-up dispatch and training tasks the broker lost (training.sweep.training_jobs_sweep);
# multi-part uploads past their hour, whose parts are deleted (training.uploads.uploads_expire).
CELERY_BEAT_SCHEDULE = {
    "training-jobs-sweep": {"task": "training.tasks.training_jobs_sweep", "schedule": 60.0},
    "training-uploads-expire": {"task": "training.tasks.uploads_expire", "schedule": 60.0},
}

# Gateway resilience (docs/gateway.md, "Resilience"): circuit breakers per adapter version (the
# settings' one instance, which the serving worker reads too: runtime.settings), canary
# auto-abort, outlier ejection of workers, load shedding, the Redis-outage fallback, and the
# demand model and loop behind prewarming. Rates are fractions (0.3 = 30 %).
GATEWAY_BREAKERS = platform.breakers
GATEWAY_CANARY_ABORT = GATEWAY_SETTINGS.canary_abort
GATEWAY_OUTLIERS = GATEWAY_SETTINGS.outliers
GATEWAY_SHEDDING = GATEWAY_SETTINGS.shedding
GATEWAY_REDIS = GATEWAY_SETTINGS.redis
GATEWAY_PREWARM = GATEWAY_SETTINGS.prewarm
GATEWAY_PREWARM_LOOP = GATEWAY_SETTINGS.prewarm_loop

# One handler on the root, text or JSON lines with the request id (runtime.logs; LOG_FORMAT,
# LOG_LEVEL); the Celery worker applies the same (lora_platform.celery).
LOGGING = logging_config(platform.log_format, platform.log_level,
                         quiet_tasks=[str(entry["task"]) for entry in CELERY_BEAT_SCHEDULE.values()])
