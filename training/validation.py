"""Checks a JSONL dataset line by line, in the style of OpenAI's fine-tuning format checker.

Every problem carries its 1-based line number and a code (`invalid_json`, `missing_messages_list`,
`unrecognized_role`, `missing_content`, `example_missing_assistant_message`, …); the list is capped,
with a count per code for the rest. Statistics use the base model's tokenizer: examples, tokens,
trained tokens, the longest example and how many will be truncated at a given sequence length.
The file is read as a stream, one line at a time, so its size does not matter; the time it may
take is bounded (`time_budget_s`, TRAINING_VALIDATION_TIMEOUT_SECONDS). No Django here.
"""

from __future__ import annotations

import codecs
import json
import math
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from serving.contracts.request_caps import MAX_JSON_DEPTH, too_deep
from training import preference
from training.examples import (
    EncodingError,
    Example,
    Problem,
    detect_format,
    load_json_line,
    parse_example,
)
from training.preference import PreferenceExample

MAX_REPORTED_PROBLEMS = 100
# A line longer than this is refused rather than held in memory (a JSONL example is rarely > 1 MB).
MAX_LINE_BYTES = 16 * 1024 * 1024
# A line nested deeper is refused before it is parsed, as the APIs refuse such a body: an example is
# a few levels deep, a tool's parameters a few more, and every level costs the schema checks recursion.
MAX_LINE_DEPTH = MAX_JSON_DEPTH
# OpenAI's checker asks for at least 10 examples; fewer train, but rarely well.
RECOMMENDED_MIN_EXAMPLES = 10
READ_CHUNK_BYTES = 1024 * 1024
# The errors a line's content can make parsing or tokenizing raise; each becomes that line's error.
# (Deliberately not Exception: a task's time limit, also an Exception, must still stop validation.)
LINE_ERRORS = (ArithmeticError, AttributeError, LookupError, TypeError, ValueError)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


@dataclass(frozen=True)
class LineProblem:
    line: int | None
    code: str
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"line": self.line, "code": self.code, "message": self.message}


@dataclass
class ValidationReport:
    format: str | None = None
    num_examples: int = 0
    errors: list[LineProblem] = field(default_factory=list)
    warnings: list[LineProblem] = field(default_factory=list)
    error_counts: Counter = field(default_factory=Counter)
    warning_counts: Counter = field(default_factory=Counter)
    stats: dict[str, Any] = field(default_factory=dict)
    max_problems: int = MAX_REPORTED_PROBLEMS

    @property
    def is_valid(self) -> bool:
        return not self.error_counts

    def add_error(self, line: int | None, problem: Problem) -> None:
        self._add(self.errors, self.error_counts, line, problem)

    def add_warning(self, line: int | None, problem: Problem) -> None:
        self._add(self.warnings, self.warning_counts, line, problem)

    def _add(self, kept: list[LineProblem], counts: Counter, line: int | None, problem: Problem) -> None:
        counts[problem.code] += 1
        if len(kept) < self.max_problems:
            kept.append(LineProblem(line, problem.code, problem.message))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "num_examples": self.num_examples,
            "valid": self.is_valid,
            "errors": [problem.to_dict() for problem in self.errors],
            "error_counts": dict(self.error_counts),
            "errors_truncated": sum(self.error_counts.values()) > len(self.errors),
            "warnings": [problem.to_dict() for problem in self.warnings],
            "warning_counts": dict(self.warning_counts),
            "warnings_truncated": sum(self.warning_counts.values()) > len(self.warnings),
            "stats": self.stats,
        }


class LineTooLong(ValueError):
    pass


class Readable(Protocol):
    """What iter_lines reads: a binary file, an S3 body, a stream that hashes what it reads."""

    def read(self, size: int = -1, /) -> bytes: ...


def iter_lines(stream: Readable, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The stream's lines without their end-of-line, read in chunks (S3 bodies yield chunks, not lines).

    A UTF-8 byte order mark before the first line is dropped, as OpenAI's fine-tuning accepts it
    (editors on Windows write one; it was line 1's `invalid_json`). Raises LineTooLong (after
    yielding every line before it) when a line exceeds max_line_bytes.
    """
    lines = _split_lines(stream, max_line_bytes)
    first = next(lines, None)
    if first is None:
        return
    yield first.removeprefix(codecs.BOM_UTF8)
    yield from lines


def _split_lines(stream: Readable, max_line_bytes: int) -> Iterator[bytes]:
    pending = b""
    while chunk := stream.read(READ_CHUNK_BYTES):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r")
        if len(pending) > max_line_bytes:
            raise LineTooLong(f"a line is longer than {max_line_bytes} bytes")
    if pending:
        yield pending.rstrip(b"\r")


def iter_valid_examples(lines: Iterable[bytes], fmt: str) -> Iterator[Example]:
    """The examples of a file that passed validation, in order (for training)."""
    for raw in lines:
        if not raw.strip():
            continue
        example, errors, _ = parse_example(load_json_line(raw), fmt)
        if example is None:
            raise ValueError(f"the dataset no longer validates: {errors[0].message}")
        yield example


def validate_lines(lines: Iterable[bytes], *, tokenizer: Any | None, max_seq_length: int,
                   max_problems: int = MAX_REPORTED_PROBLEMS, time_budget_s: float = math.inf,
                   clock: Callable[[], float] = time.monotonic) -> ValidationReport:
    """The report for a JSONL file given as its lines (bytes). `tokenizer` None skips token stats.

    Past `time_budget_s` (checked before each line) the check stops with a `validation_timeout`
    error at the line it stopped before: one file may not hold a validation slot for longer.
    """
    report = ValidationReport(max_problems=max_problems)
    tokens = _TokenStats(tokenizer, max_seq_length)
    line_number = 0
    deadline = clock() + time_budget_s
    try:
        for line_number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            if clock() >= deadline:
                report.add_error(line_number, timeout_problem(time_budget_s))
                break
            try:
                _check_line(line_number, raw, report, tokens)
            except RecursionError:
                report.add_error(line_number, _too_deep())
            except LINE_ERRORS as error:
                # Whatever else a line's content makes the parser or the tokenizer raise is that
                # line's problem, not the end of the validation.
                report.add_error(line_number, Problem("unprocessable_line", f"Line could not be checked "
                                                                            f"({type(error).__name__}: {error})."))
    except LineTooLong as error:
        report.add_error(line_number + 1, Problem("line_too_long", f"Line is too long: {error}."))
    if report.num_examples == 0 and not report.error_counts:
        report.add_error(None, Problem("empty_file", "The file has no examples (it is empty or only blank lines)."))
    elif report.is_valid and report.num_examples < RECOMMENDED_MIN_EXAMPLES:
        report.add_warning(None, Problem(
            "few_examples", f"Only {report.num_examples} example(s); at least {RECOMMENDED_MIN_EXAMPLES} "
                            "are recommended."))
    report.stats = tokens.summary(report.num_examples)
    if tokens.truncated:
        report.add_warning(None, Problem(
            "examples_truncated", f"{tokens.truncated} example(s) are longer than {max_seq_length} tokens and "
                                  "will be truncated (raise max_seq_length or shorten them)."))
    return report


def timeout_problem(budget_s: float) -> Problem:
    """The error of a file whose check ran out of its time budget (here, or at the task's time limit)."""
    return Problem("validation_timeout", f"Validation of this file did not finish within its {budget_s:g} s budget; "
                                         "split it into smaller files, or simplify its largest lines (deeply "
                                         "nested or very large tool schemas), and upload them again.")


def _too_deep() -> Problem:
    return Problem("json_too_deep", f"Line nests arrays and objects more than {MAX_LINE_DEPTH} levels deep; an example "
                                    "is a flat JSON object, and its tools' parameters a few levels more.")


def _check_line(line_number: int, raw: bytes, report: ValidationReport, tokens: _TokenStats) -> None:
    if too_deep(raw.decode("utf-8", "replace"), MAX_LINE_DEPTH):
        report.add_error(line_number, _too_deep())
        return
    try:
        value = load_json_line(raw)
    except ValueError as error:
        report.add_error(line_number, Problem("invalid_json", f"Line is not valid JSON: {error}."))
        return
    if _has_lone_surrogate(raw, value):
        report.add_error(line_number, Problem("invalid_unicode", "Line has a lone UTF-16 surrogate escape (such as "
                                                                 "\\ud800), which is no character; fix its text."))
        return
    if report.format is None:
        report.format = detect_format(value) or preference.detect(value)
        if report.format is None:
            report.add_error(line_number, _unrecognized(value))
            return
    parsed: tuple[Example | PreferenceExample | None, list[Problem], list[Problem]] = (
        preference.parse(value) if report.format == preference.PREFERENCE else parse_example(value, report.format))
    example, errors, warnings = parsed
    for problem in errors:
        report.add_error(line_number, problem)
    for problem in warnings:
        report.add_warning(line_number, problem)
    if example is not None:
        report.num_examples += 1
        tokens.add(line_number, example, report)


def _has_lone_surrogate(raw: bytes, value: Any) -> bool:
    """JSON may escape a surrogate with no partner ("\\ud800"); Python keeps it, no tokenizer takes it."""
    if not _SURROGATE_ESCAPE.search(raw):
        return False  # the usual line: no escape of the surrogate range at all
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _unrecognized(value: Any) -> Problem:
    if not isinstance(value, dict):
        return Problem("data_type", "Each line must be a JSON object.")
    return Problem("unrecognized_format",
                   "The object has none of 'messages' (chat), 'prompt'/'completion', 'text' or "
                   "'input'/'preferred_output'/'non_preferred_output' (preference); "
                   f"its keys are {', '.join(repr(key) for key in sorted(value)) or 'none'}.")


class _TokenStats:
    """Token counts of the valid examples with the base tokenizer."""

    def __init__(self, tokenizer: Any | None, max_seq_length: int) -> None:
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        self.total = 0
        self.trained = 0
        self.longest = 0
        self.longest_line: int | None = None
        self.truncated = 0
        self.untrainable = 0
        # Examples by token length, in power-of-two buckets (the dashboard's histogram).
        self.histogram: Counter = Counter()

    def add(self, line: int, example: Example | PreferenceExample, report: ValidationReport) -> None:
        if self.tokenizer is None:
            return
        try:
            # A preference pair counts the tokens of both its sequences.
            encoded = preference.encode_for_stats(example, self.tokenizer, self.max_seq_length)
        except EncodingError as error:
            report.add_error(line, Problem("unsupported_by_base_model", str(error)))
            return
        self.total += encoded.full_length
        self.trained += encoded.num_trained_tokens
        self.truncated += encoded.truncated
        if encoded.num_trained_tokens == 0:
            # Truncation removed every token the example would teach: it will be skipped.
            self.untrainable += 1
        self.histogram[_bucket(encoded.full_length)] += 1
        if encoded.full_length > self.longest:
            self.longest, self.longest_line = encoded.full_length, line

    def summary(self, num_examples: int) -> dict[str, Any]:
        if self.tokenizer is None:
            return {"num_examples": num_examples, "tokens_counted": False}
        return {
            "num_examples": num_examples,
            "tokens_counted": True,
            "total_tokens": self.total,
            "trained_tokens": self.trained,
            "mean_tokens": round(self.total / num_examples, 1) if num_examples else 0,
            "longest_example_tokens": self.longest,
            "longest_example_line": self.longest_line,
            "max_seq_length": self.max_seq_length,
            "truncated_examples": self.truncated,
            "examples_without_trained_tokens_after_truncation": self.untrainable,
            "token_histogram": [{"up_to": edge, "count": self.histogram[edge]} for edge in sorted(self.histogram)],
        }


def _bucket(length: int) -> int:
    """The smallest power of two (at least 8) that is not below `length`."""
    edge = 8
    while edge < length:
        edge *= 2
    return edge
