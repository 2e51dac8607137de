"""ASGI entry point: `uvicorn lora_platform.asgi:application`."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")

application = get_asgi_application()
