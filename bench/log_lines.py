"""What a log line costs on the gateway's path: the access line each request writes, and the whole
access-log middleware around a request, in the standard library's logging with the platform's
formatters (runtime.logs), against structlog's JSON renderer when it is importable.

Each variant writes the same access line (method, path, status, duration, tenant, model, request
id) through one handler to a line-buffered file (one write per line, as a process's stderr does
into a file or a pipe); the figure is the mean wall time per line over `--lines`, best of
`--repeat`.

    python bench/log_lines.py [--lines 20000] [--repeat 5] [--out /tmp/loraplex-log-bench.log]

structlog is not a dependency; to compare, put it on the path: `pip install --target DIR structlog`,
then `PYTHONPATH=DIR python bench/log_lines.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.access_log import AccessLog, access_note  # noqa: E402
from runtime.logs import logging_config  # noqa: E402
from serving.contracts.request_ids import request_id_reset, request_id_set  # noqa: E402

FIELDS = {"method": "POST", "path": "/v1/chat/completions", "status": 200, "duration_ms": 12.345,
          "tenant": "acme", "model": "support-bot"}


def stdlib_logger(log_format: str, out: Path) -> logging.Logger:
    """A logger with the console handler of the platform's configuration, writing to `out`."""
    config = logging_config(log_format, "INFO")  # type: ignore[arg-type]
    handler = logging.StreamHandler(out.open("w", buffering=1))
    handler.setFormatter(config["formatters"][log_format]["()"]())
    handler.addFilter(config["filters"]["request_id"]["()"]())
    logger = logging.Logger(f"bench.{log_format}")
    logger.addHandler(handler)
    return logger


def stdlib_line(logger: logging.Logger) -> Callable[[], None]:
    def line() -> None:
        logger.info("%s %s %s %.1f ms tenant=%s model=%s", "POST", "/v1/chat/completions", 200, 12.345, "acme",
                    "support-bot", extra=FIELDS)
    return line


def structlog_line(out: Path) -> Callable[[], None] | None:
    try:
        import structlog
    except ImportError:
        return None
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True), structlog.processors.JSONRenderer()],
        logger_factory=structlog.WriteLoggerFactory(out.open("w", buffering=1)),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(request_id="req-0123456789abcdef0123456789abcdef")
    logger = structlog.get_logger("bench")

    def line() -> None:
        logger.info("access", **FIELDS)
    return line


def per_line_us(line: Callable[[], None], lines: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        for _ in range(lines):
            line()
        best = min(best, time.perf_counter() - started)
    return best / lines * 1e6


def middleware_us(log_format: str | None, out: Path, requests: int, repeat: int) -> float:
    """The whole AccessLog around a request whose application answers at once (None: its line off)."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        access_note(tenant="acme", model="support-bot")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    name = f"bench.middleware.{log_format}"
    logger = logging.getLogger(name)
    logger.handlers.clear()
    logger.propagate = False
    if log_format is None:
        logger.setLevel(logging.WARNING)
    else:
        logger.setLevel(logging.INFO)
        logger.addHandler(stdlib_logger(log_format, out).handlers[0])
    wrapped = AccessLog(app, logger=name)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"host", b"x"), (b"x-request-id", b"req-0123456789abcdef0123456789abcdef")]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        pass

    async def run() -> float:
        best = float("inf")
        for _ in range(repeat):
            started = time.perf_counter()
            for _ in range(requests):
                await wrapped(scope, receive, send)
            best = min(best, time.perf_counter() - started)
        return best / requests * 1e6

    return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("/tmp/loraplex-log-bench.log"))
    args = parser.parse_args()
    print(f"Python {platform.python_version()} on {platform.machine()}, {args.lines} lines, best of {args.repeat}")
    token = request_id_set("req-0123456789abcdef0123456789abcdef")
    try:
        for log_format in ("text", "json"):
            us = per_line_us(stdlib_line(stdlib_logger(log_format, args.out)), args.lines, args.repeat)
            print(f"stdlib logging, {log_format:4} formatter: {us:6.1f} µs per access line")
        line = structlog_line(args.out)
        if line is None:
            print("structlog: not importable (see the docstring)")
        else:
            import structlog

            us = per_line_us(line, args.lines, args.repeat)
            print(f"structlog {structlog.__version__}, JSONRenderer: {us:6.1f} µs per access line")
    finally:
        request_id_reset(token)
    for log_format in (None, "text", "json"):
        us = middleware_us(log_format, args.out, args.lines, args.repeat)
        print(f"AccessLog middleware, line {log_format or 'off'}: {us:6.1f} µs per request")


if __name__ == "__main__":
    main()
