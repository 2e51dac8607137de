"""The engine's decoding shortcut and incremental detokenizer give the text tokenizer.decode gives."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from serving.engine.detokenizer import IncrementalDetokenizer, decode_text, fast_decode


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


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_deltas_are_unchanged(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    """Token by token, then the flush, the deltas are those of the uncached method on
    tokenizer.decode, including the empty ones while a character is incomplete."""
    decode = fast_decode(tokenizer)
    for seed in range(30):
        prompt = _random_ids(tokenizer, 1000 + seed, 8)
        output = _random_ids(tokenizer, 2000 + seed, 40)
        detok = IncrementalDetokenizer(decode, prompt, skip)
        deltas = [detok.add(t) for t in output] + [detok.flush()]
        assert deltas == _reference_deltas(tokenizer, prompt, output, skip)
