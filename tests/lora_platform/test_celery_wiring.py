"""The Celery app reaches the configured Redis (embedded or real) with the long-task defaults."""

from __future__ import annotations

from lora_platform.celery import app
from lora_platform.embedded_redis import celery_redis_url


def test_celery_spells_unix_sockets_its_own_way() -> None:
    assert celery_redis_url("unix:///tmp/x/redis.socket") == "redis+socket:///tmp/x/redis.socket"
    assert celery_redis_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_broker_and_result_backend_are_reachable() -> None:
    with app.connection_for_write() as connection:
        connection.ensure_connection(max_retries=2)
    assert app.backend.client.ping()


def test_reliable_defaults_for_long_tasks() -> None:
    conf = app.conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.task_default_queue == "quick"
    assert conf.task_routes["training.tasks.training_job_run"] == {"queue": "training"}
