"""Helpers the training suites share: example data and polling (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

BASE_MODEL_NAME = "tiny-llama"

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
