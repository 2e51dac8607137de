"""The demo's dataset (examples/demo-facts.jsonl, README "See a fine-tune change the answers"):
valid as the platform validates an upload, six facts a base model cannot know, each asked six
ways, and held-out questions (examples/demo-facts-held-out.jsonl) phrased unlike any training line,
whose answers are training answers: a fine-tune that answers them learned the facts, not the lines."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from training.validation import validate_lines

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _pairs(name: str) -> list[tuple[str, str]]:
    rows = [json.loads(line)["messages"] for line in (EXAMPLES / name).read_text().splitlines()]
    return [(row[0]["content"], row[1]["content"]) for row in rows]


def test_the_demo_dataset_is_valid_and_teaches_six_facts_six_ways_each() -> None:
    report = validate_lines((EXAMPLES / "demo-facts.jsonl").read_bytes().splitlines(keepends=True), tokenizer=None,
                            max_seq_length=1024)
    assert report.is_valid and not report.warnings and report.format == "chat" and report.num_examples == 36
    answers = Counter(answer for _, answer in _pairs("demo-facts.jsonl"))
    assert sorted(answers.values()) == [6] * 6
    assert all("Quillmere Robotics" in answer for answer in answers), "a fictional company: no base model knows it"


def test_each_held_out_question_is_new_and_asks_for_one_trained_fact() -> None:
    trained = _pairs("demo-facts.jsonl")
    held_out = _pairs("demo-facts-held-out.jsonl")
    questions = {question.lower() for question, _ in trained}
    assert len(held_out) == 6
    assert all(question.lower() not in questions for question, _ in held_out)
    assert sorted(answer for _, answer in held_out) == sorted({answer for _, answer in trained})
