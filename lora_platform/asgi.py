"""ASGI entry point: `uvicorn lora_platform.asgi:application`."""

import os

from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application
from django.core.handlers.asgi import ASGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")

django_application: ASGIHandler = get_asgi_application()
if settings.SERVE_STATIC:
    # uvicorn serves no files; without this the admin and dashboard would have no CSS or JS.
    django_application = ASGIStaticFilesHandler(django_application)
# Imported once Django is set up (it reaches the models). The gateway's completion routes skip
# Django's middleware thread hops (and never serve a static file); see serving.gateway.asgi.
from serving.gateway.asgi import GatewayRoutes  # noqa: E402

application = GatewayRoutes(django_application)
