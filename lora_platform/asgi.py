"""ASGI entry point: `uvicorn lora_platform.asgi:application --http lora_platform.asgi:HTTPProtocol`
(the launcher's, compose's and the image's command line: lora_platform.launcher.web_argv).

`application` is Django behind the gateway's completion routes, all of it behind the body limit
(lora_platform.body_limit), so no route buffers an oversized body, and the access log in front
(runtime.access_log: one line per request, its X-Request-ID taken or minted and returned).
`HTTPProtocol` is uvicorn's h11 protocol with a header-read timeout, the keep-alive timeout and a
per-client connection cap from the settings (runtime.http_guard, docs/web-server.md).
"""

import os

from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler

from runtime.http_guard import guarded_h11_protocol

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")

django_application: ASGIHandler = get_asgi_application()
if settings.SERVE_STATIC:
    # uvicorn serves no files; without this the admin and dashboard would have no CSS or JS.
    django_application = ASGIStaticFilesHandler(django_application)
# Imported once Django is set up (they reach the models). The gateway's completion routes skip
# Django's middleware thread hops (and never serve a static file); see serving.gateway.asgi.
from lora_platform.body_limit import BodyLimit  # noqa: E402
from serving.gateway.asgi import GatewayRoutes  # noqa: E402
from runtime.access_log import AccessLog  # noqa: E402

# Probes and scrapes: their access lines are DEBUG.
_QUIET_PATHS = ("/metrics", "/healthz", "/readyz")
application = AccessLog(BodyLimit(GatewayRoutes(django_application)), logger="lora_platform.access",
                        quiet=_QUIET_PATHS)

HTTPProtocol = guarded_h11_protocol(header_timeout_s=settings.WEB_HEADER_TIMEOUT_SECONDS,
                                    body_idle_timeout_s=settings.WEB_BODY_TIMEOUT_SECONDS,
                                    keep_alive_s=settings.WEB_KEEP_ALIVE_SECONDS,
                                    max_connections_per_client=settings.WEB_MAX_CONNECTIONS_PER_CLIENT)
