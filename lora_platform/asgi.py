"""ASGI entry point: `uvicorn lora_platform.asgi:application`."""

import os

from django.conf import settings
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")

application = get_asgi_application()
# Imported once Django is set up (it reaches the models). The gateway's completion routes skip
# Django's middleware thread hops; see serving.gateway.asgi.
from serving.gateway.asgi import GatewayRoutes  # noqa: E402

application = GatewayRoutes(application)
if settings.SERVE_STATIC:
    # uvicorn serves no files; without this the admin and dashboard would have no CSS or JS.
    application = ASGIStaticFilesHandler(application)
