"""The one logging setup (runtime.logs): JSON lines that parse, with the request id and the
call's extra fields; text lines with the id in brackets; and a Django warning written once when
Django's own default configuration and ours are applied, as a Django process applies them."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.logs import JsonFormatter, RequestIdFilter, TextFormatter, logging_config
from serving.contracts.request_ids import request_id_reset, request_id_set

ROOT = Path(__file__).resolve().parents[2]


def logger_writing_to(stream: io.StringIO, log_format: str) -> logging.Logger:
    """A logger of its own (the process's root is pytest's) with the console handler of `log_format`."""
    config = logging_config(log_format, "INFO")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(config["formatters"][log_format]["()"]())
    handler.addFilter(config["filters"]["request_id"]["()"]())
    logger = logging.Logger(f"loraplex.test.{log_format}")
    logger.addHandler(handler)
    return logger


def test_json_lines_parse_and_carry_the_request_id_and_the_extra_fields() -> None:
    stream = io.StringIO()
    log = logger_writing_to(stream, "json")
    token = request_id_set("req-abc")
    try:
        log.info("served %s", "x", extra={"status": 200, "tenant": "acme", "duration_ms": 1.5})
    finally:
        request_id_reset(token)
    log.warning("outside a request")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    first, second, third = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert set(first) == {"ts", "level", "logger", "message", "request_id", "status", "tenant", "duration_ms"}
    assert first["message"] == "served x" and first["level"] == "INFO" and first["logger"] == "loraplex.test.json"
    assert first["request_id"] == "req-abc" and first["status"] == 200 and first["ts"].endswith("+00:00")
    assert "request_id" not in second and second["level"] == "WARNING"
    assert third["message"] == "failed" and "RuntimeError: boom" in third["exc_info"]


def test_text_lines_put_the_request_id_in_brackets() -> None:
    stream = io.StringIO()
    log = logger_writing_to(stream, "text")
    token = request_id_set("req-abc")
    try:
        log.info("inside")
    finally:
        request_id_reset(token)
    log.info("outside")
    inside, outside = stream.getvalue().splitlines()
    assert inside.endswith(" INFO loraplex.test.text [req-abc]: inside")
    assert outside.endswith(" INFO loraplex.test.text: outside")


def test_an_id_passed_in_extra_is_kept() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    record.request_id = "req-given"
    token = request_id_set("req-current")
    try:
        RequestIdFilter().filter(record)
    finally:
        request_id_reset(token)
    assert record.request_id == "req-given"


def test_values_json_cannot_hold_are_written_as_text() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    record.request = object()
    assert json.loads(JsonFormatter().format(record))["request"].startswith("<object object")
    assert TextFormatter().format(record).endswith(" INFO x: m")


def test_an_unknown_format_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="LOG_FORMAT must be text or json, got 'yaml'"):
        logging_config("yaml", "INFO")


# Django's configure_logging in a process of its own: DEFAULT_LOGGING, then the settings' LOGGING.
_DJANGO_PROCESS = """
import logging, logging.config
from django.conf import settings
from django.utils.log import DEFAULT_LOGGING
from runtime.logs import logging_config
settings.configure(DEBUG=True)
logging.config.dictConfig(DEFAULT_LOGGING)
logging.config.dictConfig(logging_config({log_format!r}, "INFO"))
logging.getLogger("django.request").warning("Not Found: /nowhere")
logging.getLogger("uvicorn.error").info("Uvicorn running")
logging.getLogger("uvicorn.access").info("GET / 200")
"""


@pytest.mark.e2e
@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_django_request_warning_is_written_once_under_debug(log_format: str) -> None:
    """Django's default configuration gives `django` a console handler of its own, active under
    DEBUG, while `django` also propagates to the root's: each warning was printed twice."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_DJANGO_PROCESS.format(log_format=log_format))],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    lines = result.stderr.splitlines()
    assert sum("Not Found: /nowhere" in line for line in lines) == 1, result.stderr
    assert sum("Uvicorn running" in line for line in lines) == 1, "uvicorn's lines go through the root's handler"
    assert not any("GET / 200" in line for line in lines), "uvicorn's access lines are replaced by the platform's"
    if log_format == "json":
        assert [json.loads(line)["logger"] for line in lines] == ["django.request", "uvicorn.error"]


def test_the_periodic_tasks_routine_lines_are_quiet_and_their_failures_are_not() -> None:
    # Issue 39, item 8: beat's and the worker's lines about the every-minute repairs filled the log.
    import logging.config

    from celery.app.trace import LOG_SUCCESS

    stream = io.StringIO()
    config = logging_config("text", "INFO", quiet_tasks=["training.tasks.training_jobs_sweep"])
    config["handlers"]["console"]["stream"] = stream
    logging.config.dictConfig(config)
    try:
        logging.getLogger("celery.beat").info("Scheduler: Sending due task training-jobs-sweep")
        trace = logging.getLogger("celery.app.trace")
        done = {"id": "1", "runtime": 0.01, "return_value": None}
        trace.info(LOG_SUCCESS, {**done, "name": "training.tasks.training_jobs_sweep"})
        trace.info(LOG_SUCCESS, {**done, "name": "training.tasks.run_training_job"})
        trace.error("Task %(name)s[%(id)s] raised", {"id": "2", "name": "training.tasks.training_jobs_sweep"})
    finally:
        logging.config.dictConfig(logging_config("text", "INFO"))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert "run_training_job[1] succeeded" in lines[0] and "training_jobs_sweep[2] raised" in lines[1]
