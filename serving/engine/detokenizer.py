"""Turning generated token ids into text one token at a time, and cutting at stop strings.

Decoding token by token is not the same as decoding each token alone: byte-level BPE and
sentencepiece tokens only become valid text next to their neighbours (a multi-byte character split
over two tokens, a leading space). So each step decodes a short window ending at the new token and
emits what it adds to the window's earlier text, holding back while the text ends in an incomplete
character (the method of Hugging Face's text-generation-inference and vLLM).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

# Tokens of the prompt decoded with the first generated ones, so the first token's leading space
# or merged bytes come out as they would in the whole text.
_PROMPT_CONTEXT = 5


def decode_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], skip_special_tokens: bool) -> str:
    """``tokenizer.decode`` of one sequence of ids. transformers types ``decode`` for a batch too
    (``str | list[str]``); one flat list decodes to one string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    if not isinstance(text, str):
        raise TypeError(f"{type(tokenizer).__name__}.decode of one sequence returned {type(text).__name__}")
    return text


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_id: int) -> str:
        """Text that ``token_id`` adds to the output ("" while a character is incomplete)."""
        self._ids.append(token_id)
        prefix = decode_text(self._tokenizer, self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode_text(self._tokenizer, self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end of the output: whatever is held back, incomplete character included (as the
        replacement character, as a whole-text decode shows it)."""
        prefix = decode_text(self._tokenizer, self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode_text(self._tokenizer, self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix) :]


def find_stop(text: str, new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string that ends within the last ``new_chars`` characters of ``text``.

    Returns ``(index where it starts, the stop string)``, or None. Only occurrences that the new
    text completes are searched, so each step costs the length of the new text, not of all of it.
    """
    found: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index >= 0 and (found is None or index < found[0]):
            found = (index, stop)
    return found
