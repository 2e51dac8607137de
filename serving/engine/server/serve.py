"""Running the worker under uvicorn, with the worker's own SIGTERM handling.

uvicorn's default handler stops listening and waits for open connections; it knows nothing of the
engine. Here SIGTERM (or Ctrl-C) first starts the worker's drain, so in-flight requests get the
grace period and are then aborted cleanly (their responses still end properly), and the process
exits with status 0 instead of re-raising the signal. A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.config
import math
import signal
import sys
from collections.abc import Iterator, Sequence

import uvicorn

from serving.engine.server.app import build_app
from serving.engine.server.cli import ServerArgs, parse_args
from serving.engine.server.worker import Worker
from runtime.http_guard import guarded_h11_protocol
from runtime.access_log import AccessLog
from runtime.logs import logging_config
from serving.contracts.registry import WORKER_KEEP_ALIVE_S
from runtime.settings import platform_settings

# Beyond the drain's grace period, how long uvicorn waits for responses to finish before it
# cancels them: only a response that ignores the abort would ever need it.
_BACKSTOP_S = 5.0
# Probes and scrapes: their access lines are DEBUG (runtime.access_log).
_QUIET_PATHS = ("/health", "/healthz", "/readyz", "/metrics")


class _WorkerServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, worker: Worker) -> None:
        super().__init__(config)
        self.worker = worker

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
            return
        logging.getLogger(__name__).info("%s received: shutting down", signal.Signals(sig).name)
        self.worker.begin_drain()
        self.should_exit = True

    def request_stop(self) -> None:
        self.should_exit = True


def uvicorn_config(worker: Worker, args: ServerArgs) -> uvicorn.Config:
    """The worker's HTTP server: its app behind the access log (one line per request, with the
    gateway's X-Request-ID), address, logging, shutdown backstop, keep-alive, header timeout and
    per-client connection cap (runtime.http_guard)."""
    return uvicorn.Config(
        AccessLog(build_app(worker), logger="serving.engine.server.access", quiet=_QUIET_PATHS),
        host=args.host,
        port=args.port,
        http=guarded_h11_protocol(header_timeout_s=args.header_timeout, body_idle_timeout_s=args.body_timeout,
                                  max_connections_per_client=args.max_connections_per_client),
        log_level=args.uvicorn_log_level,
        # The process's logging is set up already (main); uvicorn's own configuration would give its
        # loggers handlers and a format of their own, and its access lines would repeat AccessLog's.
        log_config=None,
        access_log=False,
        # uvicorn takes whole seconds; rounding up only lengthens the backstop.
        timeout_graceful_shutdown=math.ceil(args.timeout_graceful_shutdown + _BACKSTOP_S),
        timeout_keep_alive=WORKER_KEEP_ALIVE_S,
        lifespan="on",
    )


def serve(args: ServerArgs) -> int:
    """Run until SIGTERM; the exit status (0, or 1 when the worker could not start)."""
    worker = Worker(args)
    config = uvicorn_config(worker, args)
    server = _WorkerServer(config, worker)
    worker.request_stop = server.request_stop
    # --switch-interval (0.5 ms by default): the engine thread and the event loop share the GIL; the
    # engine releases it around each CUDA call and must take it back from a loop busy streaming
    # tokens, and at CPython's default 5 ms each such wait can last 5 ms. On the H200 at 96 req/s
    # (bench/serve.py, py-spy) the step's input copies were 28 % of the engine thread's samples at
    # 5 ms and 8 % at 0.5 ms, and 64 req/s gave 3,944 output tok/s against 3,666 (docs/benchmarks.md).
    sys.setswitchinterval(args.switch_interval)
    server.run()
    return worker.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        # The platform's one log setup (LOG_FORMAT, LOG_LEVEL); --uvicorn-log-level is uvicorn's own.
        settings = platform_settings()
        logging.config.dictConfig(logging_config(settings.log_format, settings.log_level))
        return serve(args)
    except ValueError as exc:  # a setting the engine refuses, before anything started
        print(f"error: {exc}", file=sys.stderr)
        return 2
