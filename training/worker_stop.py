"""A Celery worker's clean stop, as a training run sees it: `stop_requested()`.

A warm shutdown (SIGTERM or Ctrl-C to the worker, `make up` stopping, `docker stop`) waits for the
running tasks to finish, and a training task may run for hours: the platform would kill it once
its stop timeout passed, leaving the job "running" with a fresh lease until that lease expired. So
the worker's main process, on its shutdown, tells each pool process with STOP_SIGNAL, and a run
there stops before its next step, saves a checkpoint of it, releases the job's lease and sends the
job's task again, which the next worker takes at once (training.run).

Why a signal of our own: the pool processes reset SIGTERM to its default (Celery terminates them
with it) and ignore SIGINT; nothing else reaches a pool process from the main one. With a pool that
runs tasks in the main process (solo, threads) the flag is set there directly.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from celery.signals import worker_process_init, worker_ready, worker_shutting_down

logger = logging.getLogger(__name__)

STOP_SIGNAL = signal.SIGUSR2
_stop = threading.Event()
_pool: Any = None  # the task pool of this main process (its processes' pids)


def stop_requested() -> bool:
    """True once this worker is stopping: a run saves its checkpoint and gives the job back."""
    return _stop.is_set()


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    _stop.set()


@worker_ready.connect
def _remember_pool(sender: Any, **_: object) -> None:
    """In the main process, once its pool runs (the sender is the worker's consumer)."""
    global _pool
    _pool = sender.pool


@worker_process_init.connect
def _listen_for_stop(**_: object) -> None:
    """In each pool process, before its first task."""
    signal.signal(STOP_SIGNAL, _on_stop_signal)


@worker_shutting_down.connect
def _tell_pool_processes(**_: object) -> None:
    """In the main process, from its shutdown signal handler: only flags and signals here."""
    _stop.set()
    processes = _pool.info.get("processes", []) if _pool is not None else []
    for pid in processes:
        try:
            os.kill(pid, STOP_SIGNAL)
        except ProcessLookupError:
            pass  # that process has already exited
