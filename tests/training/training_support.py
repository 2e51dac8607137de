"""Helpers the training suites share: example data, polling, the environment of platform processes
(fixtures live in conftest.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

BASE_MODEL_NAME = "tiny-llama"
ROOT = Path(__file__).resolve().parents[2]

# Questions with short fixed answers: a few dozen steps are enough for the adapter to learn them.
QA = [
    ("What is the capital of Italy?", "Rome."),
    ("How many days are in a week?", "Seven."),
    ("What color is the sky on a clear day?", "Blue."),
    ("Say hello.", "Hello! How are you today?"),
    ("What is the sum of 12 and 30?", "42."),
    ("Where does the train leave from?", "Platform 4."),
    ("When does the library open?", "At nine."),
    ("Who wrote the letter?", "She did."),
]


def chat_lines(repeat: int = 2) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": question},
                          {"role": "assistant", "content": answer}]}
            for _ in range(repeat) for question, answer in QA]


def jsonl(rows: list) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def wait_for(predicate: Callable[[], object], timeout: float, what: str, poll: float = 0.2) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def database_url() -> str:
    """The URL of the test database this process uses, for worker subprocesses."""
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{db['NAME']}"
    credentials = quote(db["USER"] or "", safe="") + (f":{quote(db['PASSWORD'], safe='')}" if db["PASSWORD"] else "")
    return f"postgres://{credentials}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def process_env(settings, extra: dict[str, object]) -> dict[str, str]:
    """The environment of a platform process on this test's database, storage and base model."""
    env = dict(os.environ)
    env.update({
        "DJANGO_SETTINGS_MODULE": "lora_platform.settings",
        "DATABASE_URL": database_url(),
        "STORAGE_URL": settings.STORAGE_URL,
        "BASE_MODEL_PATH": str(settings.BASE_MODEL_PATH),
        "BASE_MODEL_NAME": settings.BASE_MODEL_NAME,
        "LOG_LEVEL": "INFO",
        # One compute thread: on a shared 2-core machine, OpenMP threads spinning against other
        # processes make a tiny model's step 10-20x slower.
        "OMP_NUM_THREADS": "1",
        **({"S3_ENDPOINT_URL": settings.S3_ENDPOINT_URL} if settings.S3_ENDPOINT_URL else {}),
    })
    env.update({key: str(value) for key, value in extra.items()})
    return env


def sdk(app: Any, key: str) -> Any:
    """OpenAI's SDK talking HTTP to the WSGI application in this process (httpx's WSGI transport)."""
    import httpx2
    import openai

    # No retries: the SDK retries 409s and 5xx by default, which would hide what one request did.
    return openai.OpenAI(api_key=key, base_url="http://testserver/v1", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.WSGITransport(app=app)))


def error_of(raised: Any) -> dict:
    """The OpenAI error body of a raised SDK error (a pytest.ExceptionInfo), checked for its four fields."""
    body = raised.value.body
    assert set(body) == {"message", "type", "code", "param"}, body
    return body
