"""The Celery app, configured from Django settings (the CELERY_ namespace); tasks autodiscovered.

Its logging is the platform's (settings.LOGGING: runtime.logs), not Celery's own: a receiver
of `setup_logging` makes Celery leave logging alone, so task loggers too write through the one root
handler, in LOG_FORMAT, at LOG_LEVEL (a worker's --loglevel no longer applies).
"""

import logging.config
import os
from typing import Any

from celery import Celery
from celery.signals import setup_logging

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")

app = Celery("loraplex")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@setup_logging.connect
def _platform_logging(**_: Any) -> None:
    from django.conf import settings

    logging.config.dictConfig(settings.LOGGING)
