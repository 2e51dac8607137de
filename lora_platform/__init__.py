"""The Django project package (wiring only): settings, URLs, ASGI/WSGI, the Celery app, the launcher.

It is not named `platform/` as the design card had it: that name shadows Python's own `platform`
module, which Django, Celery and redis-py import.
"""

from lora_platform.celery import app as celery_app

__all__ = ["celery_app"]
