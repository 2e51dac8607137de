"""Turning generated token ids into text one token at a time (stop strings are found in it by
serving.engine.stop_strings).

Decoding token by token is not the same as decoding each token alone: byte-level BPE and
sentencepiece tokens only become valid text next to their neighbours (a multi-byte character split
over two tokens, a leading space). So each step decodes a short window ending at the new token and
emits what it adds to the window's earlier text, holding back while the text ends in an incomplete
character (the method of Hugging Face's text-generation-inference and vLLM).
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_base import PreTrainedTokenizerBase as _BaseTokenizer
from transformers.tokenization_utils_tokenizers import TokenizersBackend

# ``decode(token_ids, skip_special_tokens)``: one sequence of ids to its text.
Decode = Callable[[list[int], bool], str]

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


def fast_decode(tokenizer: PreTrainedTokenizerBase) -> Decode:
    """``decode_text`` for ``tokenizer``, straight to its Rust tokenizer where that gives the same
    text: the engine decodes twice per generated token, and ``tokenizer.decode``'s Python wrapper
    (argument conversion, batch checks, clean-up dispatch) costs 5 × the Rust decode itself.

    The shortcut is taken only for a plain ``TokenizersBackend`` (``decode``/``_decode`` not
    overridden) whose ``_decode`` would return the Rust text unchanged: no clean-up of spaces, or
    a BPE model, for which transformers skips the clean-up (Llama-3's case). Anything else goes
    through ``tokenizer.decode``."""
    kind = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and kind._decode is TokenizersBackend._decode
        and kind.decode is _BaseTokenizer.decode
    )
    if plain:
        assert isinstance(tokenizer, TokenizersBackend)
        backend = tokenizer.backend_tokenizer
        cleans = bool(tokenizer.clean_up_tokenization_spaces) and (
            type(backend.model).__name__ != "BPE"
            or bool(tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output)
        )
        if not cleans:
            rust_decode: Callable[..., str] = backend.decode
            return lambda ids, skip: rust_decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: decode_text(tokenizer, ids, skip)


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._decode = decode
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The text of ids[prefix_offset:read_offset], kept while those offsets stay: a token that
        # ends inside a character (or adds no text) then costs one decode instead of two.
        self._prefix_text: str | None = None

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        return self._prefix_text

    def add(self, token_id: int) -> str:
        """Text that ``token_id`` adds to the output ("" while a character is incomplete)."""
        self._ids.append(token_id)
        prefix = self._prefix()
        full = self._decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = None
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end of the output: whatever is held back, incomplete character included (as the
        replacement character, as a whole-text decode shows it)."""
        prefix = self._prefix()
        full = self._decode(self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = None
        return full[len(prefix) :]
