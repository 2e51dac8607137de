"""Turning generated token ids into text one token at a time (stop strings are found in it by
serving.engine.stop_strings).

Decoding token by token is not the same as decoding each token alone: byte-level BPE and
sentencepiece tokens only become valid text next to their neighbours (a multi-byte character split
over two tokens, a leading space). So each step decodes a short window ending at the new token and
emits what it adds to the window's earlier text, holding back while the text ends in an incomplete
character (the method of Hugging Face's text-generation-inference and vLLM).

For a byte-level BPE tokenizer (GPT-2's, Llama-3's, Qwen's) the decode of any window is its
tokens' bytes joined and read as UTF-8, U+FFFD for each invalid or incomplete character
(``TokenBytes``), and the detokenizer keeps bytes instead of ids. Once a text that does not end in
U+FFFD is sent, the window's text ends on a whole character, where reading UTF-8 starts afresh: the
window then reads as that text followed by the unsent bytes' own reading, so the method above comes
down to reading the unsent bytes alone and sending them unless they end in U+FFFD: no decode at
all, and the same deltas.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer, decoders
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


def _rust_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Tokenizer | None:
    """The Rust tokenizer whose ``decode`` gives ``decode_text``'s text, or None: a plain
    ``TokenizersBackend`` (``decode``/``_decode`` not overridden) whose ``_decode`` would return the
    Rust text unchanged: no clean-up of spaces, or a BPE model, for which transformers skips the
    clean-up (Llama-3's case)."""
    kind = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and kind._decode is TokenizersBackend._decode
        and kind.decode is _BaseTokenizer.decode
    )
    if not plain:
        return None
    assert isinstance(tokenizer, TokenizersBackend)
    backend: Tokenizer = tokenizer.backend_tokenizer
    cleans = bool(tokenizer.clean_up_tokenization_spaces) and (
        type(backend.model).__name__ != "BPE"
        or bool(tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output)
    )
    return None if cleans else backend


def fast_decode(tokenizer: PreTrainedTokenizerBase) -> Decode:
    """``decode_text`` for ``tokenizer``, straight to its Rust tokenizer where that gives the same
    text (``_rust_tokenizer``): the engine decodes twice per generated token, and
    ``tokenizer.decode``'s Python wrapper (argument conversion, batch checks, clean-up dispatch)
    costs 5 × the Rust decode itself. Anything else goes through ``tokenizer.decode``."""
    backend = _rust_tokenizer(tokenizer)
    if backend is not None:
        rust_decode: Callable[..., str] = backend.decode
        return lambda ids, skip: rust_decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: decode_text(tokenizer, ids, skip)


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's ``bytes_to_unicode``) read back: each char to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()


class TokenBytes:
    """Each token's bytes as a byte-level decoder joins them (the Rust ``ByteLevel`` decoder: a
    token's chars mapped back to bytes, or its UTF-8 when a char is outside the alphabet, as an
    added token's may be), the decode of a window being those bytes joined and read as UTF-8 with
    U+FFFD for invalid bytes. Special tokens have none when skipped, as the Rust decode drops them
    before its decoder; so do ids outside the vocabulary. Filled on first use of each id."""

    def __init__(self, backend: Tokenizer) -> None:
        self._to_token = backend.id_to_token
        self._special = {tid for tid, added in backend.get_added_tokens_decoder().items() if added.special}
        # By skip_special_tokens.
        self.tables: dict[bool, dict[int, bytes]] = {False: {}, True: {}}

    def load(self, token_id: int, skip: bool) -> bytes:
        """``token_id``'s bytes, now in ``tables[skip]``."""
        token = self._to_token(token_id)
        if token is None or (skip and token_id in self._special):
            data = b""
        else:
            try:
                data = bytes(_BYTE_LEVEL_CHARS[char] for char in token)
            except KeyError:
                data = token.encode()
        self.tables[skip][token_id] = data
        return data


def token_bytes(tokenizer: PreTrainedTokenizerBase) -> TokenBytes | None:
    """``TokenBytes`` for a tokenizer whose decode is its Rust tokenizer's (``_rust_tokenizer``) with
    a lone ``ByteLevel`` decoder; None for any other (sentencepiece's, a decoder sequence)."""
    backend = _rust_tokenizer(tokenizer)
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    return TokenBytes(backend)


class IncrementalDetokenizer:
    """A sequence's output text token by token: on token bytes where there are (the module's
    docstring), else on ids with ``decode``."""

    def __init__(self, decode: Decode, prompt_token_ids: list[int], skip_special_tokens: bool,
                 token_bytes: TokenBytes | None = None):
        self._decode = decode
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The text of ids[prefix_offset:read_offset], kept while those offsets stay: a token that
        # ends inside a character (or adds no text) then costs one decode instead of two.
        self._prefix_text: str | None = None
        self._tokens = token_bytes
        self._table: dict[int, bytes] = token_bytes.tables[skip_special_tokens] if token_bytes else {}
        self._unsent = b""  # on token bytes: those of the tokens whose text is not sent yet
        # On token bytes, the prompt's tokens that the first text is read after, while their text
        # may end inside a character; None once the text read before the unsent bytes ends on a
        # whole one (the prompt's, or the text sent).
        self._context: bytes | None = None
        if token_bytes is not None:
            context = b"".join(self._bytes(tid) for tid in self._ids)
            self._context = context if context.decode(errors="replace").endswith("\ufffd") else None

    def _bytes(self, token_id: int) -> bytes:
        data = self._table.get(token_id)
        if data is None:
            assert self._tokens is not None
            data = self._tokens.load(token_id, self._skip)
        return data

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        return self._prefix_text

    def add(self, token_id: int) -> str:
        """Text that ``token_id`` adds to the output ("" while a character is incomplete)."""
        if self._tokens is not None:
            return self._add_bytes(token_id)
        self._ids.append(token_id)
        prefix = self._prefix()
        full = self._decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._prefix_text = None
            return full[len(prefix) :]
        return ""

    def _add_bytes(self, token_id: int) -> str:
        data = self._table.get(token_id)
        if data is None:
            data = self._bytes(token_id)
        if not data:
            # The window's text is unchanged, so is the last call's verdict: "" (sent, or held).
            return ""
        unsent = self._unsent + data
        if self._context is None:
            text = unsent.decode(errors="replace")
            if text.endswith("\ufffd"):
                self._unsent = unsent
                return ""
            self._unsent = b""
            return text
        prefix = self._context.decode(errors="replace")
        full = (self._context + unsent).decode(errors="replace")
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._context, self._unsent = None, b""
            return full[len(prefix) :]
        self._unsent = unsent
        return ""

    def flush(self) -> str:
        """At the end of the output: whatever is held back, incomplete character included (as the
        replacement character, as a whole-text decode shows it)."""
        if self._tokens is not None:
            context = self._context or b""
            text = (context + self._unsent).decode(errors="replace")[len(context.decode(errors="replace")) :]
            self._context, self._unsent = None, b""
            return text
        prefix = self._prefix()
        full = self._decode(self._ids[self._prefix_offset :], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = None
        return full[len(prefix) :]
