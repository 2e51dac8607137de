"""The Celery app, configured from Django settings (the CELERY_ namespace); tasks autodiscovered."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")

app = Celery("loraplex")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
