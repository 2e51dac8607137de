"""The preference format (OpenAI's, for DPO): a JSON line → a pair of chat examples → a pair of token sequences.

    {"input": {"messages": [...], "tools"?: [...]},
     "preferred_output": [{"role": "assistant", "content": "…"}],
     "non_preferred_output": [{"role": "assistant", "content": "…"}]}

Each output is one assistant message replying to the input's conversation. The pair is two chat
examples, the conversation followed by either reply, checked by the chat format's own rules
(training.examples: roles, contents, tool calls) and encoded with the base model's chat template,
the loss mask on the reply only (the input's assistant messages are context). A file is in this
format when its first line has `input`, `preferred_output` or `non_preferred_output`.

Validation (training.validation) and the DPO trainer share this module, as the chat format's
validation and trainer share training.examples. No Django here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from training.examples import (CHAT, EncodedExample, Example, Problem, detect_format, encode_example, load_json_line,
                               parse_example)

PREFERENCE = "preference"
OUTPUTS = ("preferred_output", "non_preferred_output")
KEYS = frozenset({"input", *OUTPUTS})
INPUT_KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})


@dataclass(frozen=True)
class PreferenceExample:
    """A parsed preference line: the same conversation ending in the preferred and the other reply."""

    preferred: Example
    non_preferred: Example
    format: str = PREFERENCE


@dataclass(frozen=True)
class PreferencePair:
    """The pair encoded; a DPO step's unit, as an EncodedExample is a supervised step's."""

    chosen: EncodedExample
    rejected: EncodedExample

    @property
    def num_trained_tokens(self) -> int:
        """The tokens of both replies; 0 when either lost all of its to truncation (the pair teaches nothing)."""
        chosen, rejected = self.chosen.num_trained_tokens, self.rejected.num_trained_tokens
        return chosen + rejected if chosen and rejected else 0

    @property
    def truncated(self) -> bool:
        return self.chosen.truncated or self.rejected.truncated


# What a training step takes: a sequence (supervised) or a pair (DPO).
TrainItem = EncodedExample | PreferencePair


def detect(value: Any) -> str | None:
    """PREFERENCE when a JSON object's keys announce the preference format."""
    return PREFERENCE if isinstance(value, dict) and KEYS & set(value) else None


def parse(value: Any) -> tuple[PreferenceExample | None, list[Problem], list[Problem]]:
    """(example or None, errors, warnings) for one decoded JSON line of a preference file."""
    if not isinstance(value, dict):
        return None, [Problem("data_type", "Each line must be a JSON object.")], []
    other = detect_format(value)
    if other is not None and not KEYS & set(value):
        return None, [Problem("mixed_formats", f"This line is in {other} format, but the file is in preference "
                                               "format; use one format per file.")], []
    source = value.get("input")
    if not isinstance(source, dict) or not isinstance(source.get("messages"), list) or not source["messages"]:
        return None, [Problem("missing_input", "'input' must be an object with a non-empty 'messages' list (the "
                                               "conversation both outputs reply to).")], []
    errors: list[Problem] = []
    unknown = sorted(set(source) - INPUT_KEYS)
    if unknown:
        errors.append(Problem("unrecognized_input_key", f"'input' has unrecognized key(s) "
                                                        f"{', '.join(repr(key) for key in unknown)}; allowed keys "
                                                        f"are {', '.join(sorted(INPUT_KEYS))}."))
    replies = {name: _reply(value, name, errors) for name in OUTPUTS}
    if errors:
        return None, errors, []
    # The input's assistant turns are context: weight 0, so only the output is trained.
    context = [{**message, "weight": 0} if isinstance(message, dict) and message.get("role") == "assistant"
               else message for message in source["messages"]]
    examples: dict[str, Example] = {}
    for name, reply in replies.items():
        chat = {"messages": [*context, reply], **{key: source[key] for key in ("tools", "parallel_tool_calls")
                                                  if key in source}}
        example, problems, _ = parse_example(chat, CHAT)
        # The reply is the chat example's last message: its problems name the output instead.
        errors.extend(Problem(problem.code, problem.message.replace(f"messages[{len(context)}]", name))
                      for problem in problems)
        if example is not None:
            examples[name] = example
    if errors:
        # The input's problems show once, not once per output.
        return None, list(dict.fromkeys(errors)), []
    warnings = []
    extra = sorted(set(value) - KEYS)
    if extra:
        warnings.append(Problem("unrecognized_key", f"Ignored key(s) {', '.join(repr(key) for key in extra)}."))
    if replies["preferred_output"] == replies["non_preferred_output"]:
        warnings.append(Problem("identical_outputs", "The preferred and non-preferred outputs are the same: the "
                                                     "pair teaches nothing."))
    return PreferenceExample(examples["preferred_output"], examples["non_preferred_output"]), [], warnings


def _reply(value: dict[str, Any], name: str, errors: list[Problem]) -> dict[str, Any]:
    """The one assistant message of an output, or an error naming the output."""
    output = value.get(name)
    if (not isinstance(output, list) or len(output) != 1 or not isinstance(output[0], dict)
            or output[0].get("role") != "assistant"):
        errors.append(Problem(f"invalid_{name}", f"'{name}' must be a list of exactly one assistant message, like "
                                                 "[{\"role\": \"assistant\", \"content\": \"…\"}]."))
        return {}
    return {**output[0], "weight": 1}


def encode(example: PreferenceExample, tokenizer: Any, max_seq_length: int | None = None) -> PreferencePair:
    return PreferencePair(encode_example(example.preferred, tokenizer, max_seq_length),
                          encode_example(example.non_preferred, tokenizer, max_seq_length))


def encode_for_stats(example: Example | PreferenceExample, tokenizer: Any,
                     max_seq_length: int) -> EncodedExample:
    """One encoding for a dataset's token statistics: a pair counts the tokens of both its sequences."""
    if not isinstance(example, PreferenceExample):
        return encode_example(example, tokenizer, max_seq_length)
    pair = encode(example, tokenizer, max_seq_length)
    return EncodedExample(input_ids=pair.chosen.input_ids + pair.rejected.input_ids,
                          labels=pair.chosen.labels + pair.rejected.labels,
                          full_length=pair.chosen.full_length + pair.rejected.full_length, truncated=pair.truncated)


def iter_valid_pairs(lines: Iterable[bytes]) -> Iterator[PreferenceExample]:
    """The examples of a preference file that passed validation, in order (for training)."""
    for raw in lines:
        if not raw.strip():
            continue
        example, errors, _ = parse(load_json_line(raw))
        if example is None:
            raise ValueError(f"the dataset no longer validates: {errors[0].message}")
        yield example
