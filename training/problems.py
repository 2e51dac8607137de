"""What is wrong with a dataset line: the unit every check reports (training.examples,
training.chat_tools, training.validation), so each can be written without importing the others."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a line: a code in the style of OpenAI's format checker and a message."""

    code: str
    message: str
