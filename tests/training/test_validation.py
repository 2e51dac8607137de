"""Dataset validation: formats, every error code with its line number, the capped list, token stats."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable

import pytest
from transformers import AutoTokenizer

from training.validation import LineTooLong, iter_lines, validate_lines
from training_support import chat_lines, jsonl


@pytest.fixture(scope="module")
def tokenizer(base_model_dir):
    return AutoTokenizer.from_pretrained(base_model_dir)


def check(lines: Iterable[bytes] | bytes, tokenizer=None, max_seq_length: int = 512, **kwargs) -> dict:
    if isinstance(lines, bytes):
        lines = list(iter_lines(io.BytesIO(lines)))
    return validate_lines(lines, tokenizer=tokenizer, max_seq_length=max_seq_length, **kwargs).to_dict()


def codes(report: dict) -> list[tuple[int | None, str]]:
    return [(error["line"], error["code"]) for error in report["errors"]]


def user(content: str = "Hi") -> dict:
    return {"role": "user", "content": content}


def assistant(content: str = "Hello.", **extra) -> dict:
    return {"role": "assistant", "content": content, **extra}


@pytest.mark.parametrize(("rows", "fmt"), [
    (chat_lines(), "chat"),
    ([{"prompt": "2+2=", "completion": " 4"}] * 3, "completion"),
    ([{"text": "Once upon a time."}] * 3, "text"),
])
def test_each_format_is_detected_and_valid(rows, fmt, tokenizer):
    report = check(jsonl(rows), tokenizer)
    assert report["valid"] and report["format"] == fmt and report["num_examples"] == len(rows)
    assert report["stats"]["total_tokens"] >= report["stats"]["trained_tokens"] > 0


def test_chat_errors_carry_line_numbers_and_openai_checker_codes():
    lines = [
        b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}',
        b"this is not json",
        b'{"messages": "not a list"}',
        json.dumps({"messages": [user(), {"role": "wizard", "content": "x"}, assistant()]}).encode(),
        json.dumps({"messages": [user(), {"role": "assistant"}]}).encode(),
        json.dumps({"messages": [user(), user()]}).encode(),
        b"",
        json.dumps({"messages": [user(), assistant(weight=2)]}).encode(),
        json.dumps({"messages": [user(), assistant(weight=0)]}).encode(),
        json.dumps({"messages": [user(), {"role": "assistant", "content": "x", "tool": 1}]}).encode(),
        b"[1, 2]",
        json.dumps({"prompt": "a", "completion": "b"}).encode(),
        json.dumps({"messages": []}).encode(),
    ]
    report = check(lines)
    assert not report["valid"] and report["format"] == "chat" and report["num_examples"] == 1
    assert codes(report) == [
        (2, "invalid_json"), (3, "missing_messages_list"), (4, "unrecognized_role"), (5, "missing_content"),
        (6, "example_missing_assistant_message"), (8, "invalid_weight"), (9, "example_missing_assistant_message"),
        (10, "message_unrecognized_key"), (11, "data_type"), (12, "mixed_formats"), (13, "missing_messages_list"),
    ]
    assert "wizard" in report["errors"][2]["message"] and "system, user, assistant" in report["errors"][2]["message"]


def test_completion_and_text_schemas():
    report = check([b'{"prompt": "a"}', b'{"prompt": 1, "completion": "b"}', b'{"prompt": "a", "completion": ""}'])
    assert codes(report) == [(1, "missing_completion"), (2, "missing_prompt"), (3, "missing_completion")]
    report = check([b'{"text": ""}', b'{"text": "fine", "source": "web"}'])
    assert codes(report) == [(1, "missing_text")]
    assert report["warnings"][0] == {"line": 2, "code": "unrecognized_key", "message": "Ignored key(s) 'source'."}


@pytest.mark.parametrize("data", [b"", b"\n\n  \n"])
def test_empty_file(data):
    assert codes(check(data)) == [(None, "empty_file")]


def test_unrecognized_schema_names_its_keys():
    report = check(jsonl([{"question": "q", "answer": "a"}]))
    assert codes(report) == [(1, "unrecognized_format")]
    assert "'answer', 'question'" in report["errors"][0]["message"]


def test_error_list_is_capped_with_counts_per_code():
    report = check([b"{"] * 30 + [b"[]"] * 5, max_problems=10)
    assert len(report["errors"]) == 10 and report["errors_truncated"]
    assert report["error_counts"] == {"invalid_json": 30, "data_type": 5}


def test_stats_count_longest_and_truncated_examples(tokenizer):
    rows = chat_lines(repeat=1) + [{"messages": [user("word " * 200), assistant("ok")]}]
    report = check(jsonl(rows), tokenizer, max_seq_length=64)
    stats = report["stats"]
    assert stats["longest_example_line"] == len(rows) and stats["longest_example_tokens"] > 200
    assert stats["truncated_examples"] == 1 and stats["max_seq_length"] == 64
    # The only trained tokens of the long example lie beyond 64 tokens: truncation removes them all.
    assert stats["examples_without_trained_tokens_after_truncation"] == 1
    assert ("examples_truncated" in report["warning_counts"]) and report["valid"]


def test_lines_are_read_from_chunked_streams_and_over_long_lines_refused():
    data = jsonl([{"text": "a" * 50}] * 3).replace(b"\n", b"\r\n")
    assert list(iter_lines(io.BytesIO(data), max_line_bytes=100)) == [json.dumps({"text": "a" * 50}).encode()] * 3
    with pytest.raises(LineTooLong):
        list(iter_lines(io.BytesIO(b'{"text": "' + b"a" * 5000), max_line_bytes=100))
    report = check(iter_lines(io.BytesIO(b'{"text": "a"}\n' + b"x" * 500), max_line_bytes=100))
    assert codes(report) == [(2, "line_too_long")]


def test_a_utf8_byte_order_mark_before_line_1_is_dropped_as_openai_does():
    """It was line 1's `invalid_json` (issue 37, item 8). Only the file's first bytes: a mark inside
    the file is still that line's error."""
    bom = b"\xef\xbb\xbf"
    rows = [{"text": "Once upon a time."}] * 3
    assert next(iter_lines(io.BytesIO(bom + jsonl(rows)))) == json.dumps(rows[0]).encode()
    report = check(bom + jsonl(rows))
    assert report["valid"] and report["num_examples"] == 3
    report = check(jsonl(rows[:1]) + bom + jsonl(rows[:1]))
    assert codes(report) == [(2, "invalid_json")] and "BOM" in report["errors"][0]["message"]


def test_a_file_stops_at_the_line_where_its_time_budget_ran_out():
    """Issue 37, item 5: one file may not hold a validation slot without end. The clock is the test's
    (a second per look), so the line it stops at is exact and nothing waits."""
    ticks = iter(range(1000))
    rows = [{"text": "Once upon a time."}] * 5
    report = check(jsonl(rows), time_budget_s=2.5, clock=lambda: float(next(ticks)))
    assert codes(report) == [(3, "validation_timeout")] and report["num_examples"] == 2
    assert "within its 2.5 s budget" in report["errors"][0]["message"]
    assert check(jsonl(rows), time_budget_s=2.5)["valid"]  # the real clock: five lines take no 2.5 s


def test_invalid_utf8_is_invalid_json():
    report = check([b'{"text": "\xff\xfe"}'])
    assert codes(report) == [(1, "invalid_json")] and "UTF-8" in report["errors"][0]["message"]


def test_a_line_nested_too_deeply_or_with_a_lone_surrogate_is_that_lines_error(tokenizer):
    """The attacks docs/security.md lists: a 100k-deep line (RecursionError) and "\\ud800" (a tokenizer TypeError)
    used to crash the task; now each is its own line's error and the other lines are still checked."""
    good = jsonl(chat_lines(1)[:3])
    deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    surrogate = json.dumps({"messages": [user("Hi \ud800"), assistant()]}).encode() + b"\n"
    assert b"\\ud800" in surrogate
    # A real surrogate pair escaped the same way is a character, and fine.
    pair = json.dumps({"messages": [user("smile \U0001F600"), assistant()]}).encode() + b"\n"
    report = check(good + deep + surrogate + pair + good, tokenizer)
    assert codes(report) == [(4, "json_too_deep"), (5, "invalid_unicode")]
    assert report["num_examples"] == 7 and not report["valid"]
    assert report["stats"]["tokens_counted"]


def test_a_line_nested_past_the_bound_is_refused_before_it_is_parsed():
    """MAX_LINE_DEPTH (64, the APIs' bound): the object and 63 arrays inside it pass, one more does not
    (it used to pass until the parser's recursion ran out, near a thousand)."""
    def nested(arrays: int) -> bytes:
        return b'{"text": "Once.", "meta": ' + b"[" * arrays + b"]" * arrays + b"}"

    report = check([nested(63), nested(64), nested(100)])
    assert codes(report) == [(2, "json_too_deep"), (3, "json_too_deep")]
    assert "more than 64 levels" in report["errors"][0]["message"]


def test_any_other_failure_of_the_tokenizer_on_a_line_is_that_lines_error():
    class Exploding:
        def __getattr__(self, name):
            raise TypeError("the tokenizer broke")

    report = check(jsonl(chat_lines(1)[:2]), Exploding())
    assert codes(report) == [(1, "unprocessable_line"), (2, "unprocessable_line")]
    assert "TypeError: the tokenizer broke" in report["errors"][0]["message"]
