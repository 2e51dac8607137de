"""The engine's decoding shortcut and incremental detokenizer (on ids, or on token bytes for a byte-level
tokenizer) give the text tokenizer.decode gives."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from serving.engine.detokenizer import IncrementalDetokenizer, TokenBytes, decode_text, fast_decode, token_bytes


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _random_ids(tokenizer: PreTrainedTokenizerBase, seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(len(tokenizer)) for _ in range(length)]


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decode_matches_tokenizer_decode(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    decode = fast_decode(tokenizer)
    for seed in range(50):
        ids = _random_ids(tokenizer, seed, 1 + seed % 17)  # special tokens (ids < 16) included
        assert decode(ids, skip) == decode_text(tokenizer, ids, skip)


def test_fast_decode_keeps_a_requested_space_clean_up(tokenizer: PreTrainedTokenizerBase) -> None:
    """A tokenizer whose decode would clean up spaces is not short-cut: the text still matches."""
    tokenizer.clean_up_tokenization_spaces = True
    tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
    try:
        decode = fast_decode(tokenizer)
        ids = list(tokenizer("a , b . c ' d").input_ids)
        assert decode(ids, True) == decode_text(tokenizer, ids, True)
    finally:
        tokenizer.clean_up_tokenization_spaces = False
        tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = False


def _reference_deltas(tokenizer: PreTrainedTokenizerBase, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    """The incremental method without shortcut or cache: two tokenizer.decode calls per token."""
    ids, prefix_offset = prompt[-5:], 0
    read_offset = len(ids)
    deltas = []
    for token in output:
        ids.append(token)
        prefix = decode_text(tokenizer, ids[prefix_offset:read_offset], skip)
        full = decode_text(tokenizer, ids[prefix_offset:], skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            prefix_offset, read_offset = read_offset, len(ids)
            deltas.append(full[len(prefix):])
        else:
            deltas.append("")
    prefix = decode_text(tokenizer, ids[prefix_offset:read_offset], skip)
    deltas.append(decode_text(tokenizer, ids[prefix_offset:], skip)[len(prefix):])
    return deltas


def _bytes_of(tokenizer: PreTrainedTokenizerBase) -> TokenBytes:
    table = token_bytes(tokenizer)
    assert table is not None, "the tiny model's tokenizer is byte-level BPE"
    return table


@pytest.mark.parametrize("skip", [True, False])
def test_token_bytes_read_as_each_tokens_decode(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    """Every id (special tokens, ids past the vocabulary too) reads as the Rust decode of it alone."""
    table = _bytes_of(tokenizer)
    decode = fast_decode(tokenizer)
    for tid in range(len(tokenizer) + 3):
        assert table.load(tid, skip).decode(errors="replace") == decode([tid], skip), tid


@pytest.mark.parametrize("skip", [True, False])
def test_token_bytes_joined_read_as_the_decode(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    """A sequence's bytes joined read as its decode, invalid and incomplete UTF-8 included: runs of
    single-byte tokens of bytes >= 0x80 (the tokenizer's first 256 after the special tokens)."""
    table = _bytes_of(tokenizer)
    decode = fast_decode(tokenizer)
    for seed in range(200):
        rng = random.Random(seed)
        ids = [rng.choice([rng.randrange(len(tokenizer)), rng.randrange(5, 261)]) for _ in range(1 + seed % 13)]
        assert b"".join(table.load(t, skip) for t in ids).decode(errors="replace") == decode(ids, skip), ids



def test_token_bytes_of_added_tokens(tiny_model_dir: Path) -> None:
    """Added tokens, special or not, with chars inside the byte-level alphabet and outside it (the
    decoder maps each char it knows to its byte, é of an added token included): alone and between
    two tokens, each reads as the decode."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<tóol_call>", "日本", " spaced "])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|é|>"]})
    table = _bytes_of(tokenizer)
    decode = fast_decode(tokenizer)
    for tid in range(len(tokenizer) - 4, len(tokenizer)):
        for skip in (True, False):
            for ids in ([tid], [40, tid, 41]):
                assert b"".join(table.load(t, skip) for t in ids).decode(errors="replace") == decode(ids, skip)

@pytest.mark.parametrize("bytes_", [False, True], ids=["ids", "token-bytes"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_deltas_are_unchanged(tokenizer: PreTrainedTokenizerBase, skip: bool, bytes_: bool) -> None:
    """Token by token, then the flush, the deltas are those of the uncached method on
    tokenizer.decode, including the empty ones while a character is incomplete; on ids (decode)
    and on token bytes alike."""
    decode = fast_decode(tokenizer)
    table = _bytes_of(tokenizer) if bytes_ else None
    for seed in range(30):
        prompt = _random_ids(tokenizer, 1000 + seed, 8)
        output = _random_ids(tokenizer, 2000 + seed, 40)
        detok = IncrementalDetokenizer(decode, prompt, skip, table)
        deltas = [detok.add(t) for t in output] + [detok.flush()]
        assert deltas == _reference_deltas(tokenizer, prompt, output, skip)



@pytest.mark.parametrize("skip", [True, False])
def test_token_bytes_deltas_on_byte_runs(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    """Outputs mostly of single-byte tokens (ids 5 to 260), so characters are split, left
    incomplete and invalid in every way, sent windows included: the reference's deltas."""
    decode = fast_decode(tokenizer)
    table = _bytes_of(tokenizer)
    for seed in range(300):
        rng = random.Random(seed)
        prompt = [rng.randrange(5, 261) for _ in range(6)]
        output = [rng.randrange(5, 261) if rng.random() < 0.85 else rng.randrange(len(tokenizer)) for _ in range(24)]
        detok = IncrementalDetokenizer(decode, prompt, skip, table)
        deltas = [detok.add(t) for t in output] + [detok.flush()]
        assert deltas == _reference_deltas(tokenizer, prompt, output, skip), seed


@pytest.mark.parametrize("bytes_", [False, True], ids=["ids", "token-bytes"])
def test_prompt_ending_inside_a_character(tokenizer: PreTrainedTokenizerBase, bytes_: bool) -> None:
    """A prompt whose last tokens are the first two bytes of 日 and an output of its third, alone
    or followed by text: the reference's deltas (the character is the prompt's, so the output
    adds no text for it)."""
    table = _bytes_of(tokenizer)
    byte_ids = {table.load(tid, False): tid for tid in range(len(tokenizer))}
    first, second, third = ("日".encode()[i : i + 1] for i in range(3))
    prompt = list(tokenizer("x").input_ids) + [byte_ids[first], byte_ids[second]]
    for output in ([byte_ids[third]], [byte_ids[third]] + list(tokenizer(" ok", add_special_tokens=False).input_ids)):
        detok = IncrementalDetokenizer(fast_decode(tokenizer), prompt, True, table if bytes_ else None)
        deltas = [detok.add(t) for t in output] + [detok.flush()]
        assert deltas == _reference_deltas(tokenizer, prompt, output, True)

TRICKY = [
    "Héllo wörld — 日本語のテキスト 🙂👍🏽 naïve café",
    "  leading spaces,\ttabs\n\nand   runs of   spaces ",
    "<|im_start|>assistant\nspecial <|im_end|> tokens<|endoftext|> inside",
    "ZWJ 👩‍👩‍👧 flags 🇫🇷🇯🇵 and a literal \ufffd replacement char",
]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TRICKY)
def test_token_bytes_deltas_on_tricky_text(tokenizer: PreTrainedTokenizerBase, text: str, skip: bool) -> None:
    """Multi-byte characters split over tokens (the tiny tokenizer knows no CJK or emoji: they go
    byte by byte), special tokens, leading spaces: the deltas are the reference's, and together
    they are the whole sequence's decode past the prompt's."""
    decode = fast_decode(tokenizer)
    prompt = list(tokenizer("A prompt:").input_ids)
    output = list(tokenizer(text, add_special_tokens=False).input_ids)
    detok = IncrementalDetokenizer(decode, prompt, skip, _bytes_of(tokenizer))
    deltas = [detok.add(t) for t in output] + [detok.flush()]
    assert deltas == _reference_deltas(tokenizer, prompt, output, skip)
    whole = decode_text(tokenizer, prompt + output, skip)
    assert "".join(deltas) == whole[len(decode_text(tokenizer, prompt, skip)):]
    assert "".join(deltas) == (text if not skip else decode_text(tokenizer, output, True))


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> PreTrainedTokenizerBase:
    """A sentencepiece-style tokenizer (Metaspace decoder: a leading space dropped by position)."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"])
    backend.train_from_iterator(["the quick brown fox jumps over the lazy dog", "a b c d e f"] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>")  # type: ignore[no-untyped-call]


def test_no_token_bytes_without_a_byte_level_decoder(metaspace_tokenizer: PreTrainedTokenizerBase) -> None:
    """A decoder whose text depends on the token's place has no token bytes; the detokenizer on
    ids gives the reference's deltas."""
    assert token_bytes(metaspace_tokenizer) is None
    decode = fast_decode(metaspace_tokenizer)
    prompt = list(metaspace_tokenizer("the lazy dog").input_ids)
    output = list(metaspace_tokenizer("quick brown fox jumps", add_special_tokens=False).input_ids)
    for skip in (True, False):
        detok = IncrementalDetokenizer(decode, prompt, skip, token_bytes(metaspace_tokenizer))
        deltas = [detok.add(t) for t in output] + [detok.flush()]
        assert deltas == _reference_deltas(metaspace_tokenizer, prompt, output, skip)
        assert "".join(deltas) == " quick brown fox jumps"
