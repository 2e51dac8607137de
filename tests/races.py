"""Racing two calls on PostgreSQL: each in its own thread (its own database connection), started at a barrier."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import connections
from django.db.models.signals import pre_save


def race(first: Callable[[], object], second: Callable[[], object]) -> list[object]:
    """Runs both at once; each result is the return value or the exception raised."""
    barrier = threading.Barrier(2)
    results: list[object] = [None, None]

    def run(index: int, call: Callable[[], object]) -> None:
        try:
            barrier.wait()
            results[index] = call()
        except Exception as error:  # the race's outcome, inspected by the test
            results[index] = error
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(index, call)) for index, call in enumerate((first, second))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def _slow_save(sender: object, **kwargs: object) -> None:
    time.sleep(0.05)


@contextmanager
def slow_saves(model: type) -> Iterator[None]:
    """Each save of `model` waits a little inside its transaction: without the lock a race is about,
    both sides would then read the same state and both write."""
    pre_save.connect(_slow_save, sender=model)
    try:
        yield
    finally:
        pre_save.disconnect(_slow_save, sender=model)
