"""Which token-mask grammar library the engine's structured output uses: a CPU measurement.

For xgrammar, llguidance and outlines-core, on the tiny model's tokenizer and on a byte-level BPE
tokenizer of 128k tokens (trained here on generated text, as large as Llama 3's), prints the time
to compile a typical JSON schema (cold: nothing cached) and the time per token to compute the next
token's mask and advance the matcher, walking a document the schema accepts. The figures and the
choice are in docs/serving-worker.md ("Structured output").

Only the chosen library is a dependency; to run this, install the other two beside it:
    pip install xgrammar llguidance outlines-core
    python bench/grammar_libraries.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from serving.engine.tiny import build_tiny_model

SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
            "required": ["name", "email"],
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1}},
                "required": ["sku", "quantity"],
            },
            "minItems": 1,
        },
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "total": {"type": "number"},
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "status", "total"],
    "additionalProperties": False,
}

DOCUMENT = json.dumps({
    "order_id": "AB-123456",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com"},
    "items": [{"sku": "KB-01", "quantity": 2}, {"sku": "MS-07", "quantity": 1}],
    "status": "shipped",
    "total": 129.5,
    "gift": False,
}, separators=(",", ":"))


def large_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of about `vocab_size` tokens, trained on generated words."""
    rng = random.Random(0)
    alphabet = string.ascii_letters + string.digits + string.punctuation
    words = ["".join(rng.choices(alphabet, k=rng.randint(2, 12))) for _ in range(400_000)]
    lines = [" ".join(rng.choices(words, k=40)) for _ in range(40_000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_xgrammar(tok: PreTrainedTokenizerFast, tokens: list[int], repeat: int) -> tuple[float, float, float]:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    setup = time.perf_counter() - start
    schema = json.dumps(SCHEMA)
    compile_s = timed(lambda: xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(schema),
                      repeat)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(schema)
    mask = xgr.allocate_token_bitmask(1, len(tok))

    def walk() -> None:
        matcher = xgr.GrammarMatcher(compiled)
        for t in tokens:
            matcher.fill_next_token_bitmask(mask, 0)
            assert matcher.accept_token(t), t
        assert matcher.is_terminated() or matcher.accept_token(tok.eos_token_id)

    return setup, compile_s, timed(walk, repeat) / len(tokens)


def bench_llguidance(tok: PreTrainedTokenizerFast, tokens: list[int], repeat: int) -> tuple[float, float, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    start = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    setup = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))

    def compile_once() -> None:
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()

    compile_s = timed(compile_once, repeat)
    mask = llguidance.torch.allocate_token_bitmask(1, lltok.vocab_size)

    def walk() -> None:
        matcher = llguidance.LLMatcher(lltok, grammar)
        for t in tokens:
            llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(t), matcher.get_error()
        assert matcher.is_accepting()

    # The walk includes one matcher's construction; subtract it so the figure is per token.
    return setup, compile_s, max(0.0, timed(walk, repeat) - compile_s) / len(tokens)


def bench_outlines_core(tok: PreTrainedTokenizerFast, tokens: list[int], repeat: int) -> tuple[float, float, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    byte_decoder = {c: b for b, c in zip(range(256), _bytes_to_unicode())}
    vocab: dict[bytes, list[int]] = {}
    for text, tid in tok.get_vocab().items():
        if tid == tok.eos_token_id:
            continue
        raw = bytes(byte_decoder[c] for c in text) if all(c in byte_decoder for c in text) else text.encode()
        vocab.setdefault(raw, []).append(tid)
    vocabulary = Vocabulary(tok.eos_token_id, vocab)
    setup = time.perf_counter() - start
    regex = build_regex_from_schema(json.dumps(SCHEMA))
    compile_s = timed(lambda: Index(regex, vocabulary), repeat)
    index = Index(regex, vocabulary)

    def walk() -> None:
        guide = Guide(index)
        for t in tokens:
            guide.get_tokens()
            guide.advance(t)
        assert guide.is_finished() or tok.eos_token_id in guide.get_tokens()

    return setup, compile_s, timed(walk, repeat) / len(tokens)


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte → printable character table, in byte order (what ByteLevel tokens are spelt in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--large-vocab", type=int, default=128_256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = AutoTokenizer.from_pretrained(build_tiny_model(Path(tmp) / "tiny"))
        start = time.perf_counter()
        large = large_tokenizer(args.large_vocab)
        print(f"trained the {len(large)}-token tokenizer in {time.perf_counter() - start:.1f} s")
        print("| library | vocabulary | tokenizer setup ms | schema compile ms | mask + advance us/token |")
        print("| --- | --- | --- | --- | --- |")
        for name, tok in (("tiny", tiny), ("128k", large)):
            tokens = tok(DOCUMENT, add_special_tokens=False).input_ids
            for lib, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance),
                               ("outlines-core", bench_outlines_core)):
                try:
                    setup, compile_s, per_token = bench(tok, tokens, args.repeat)
                except Exception as exc:  # a library that fails here is reported, not fatal
                    print(f"| {lib} | {name} ({len(tok)}) | failed: {type(exc).__name__}: {exc} | | |")
                    continue
                print(f"| {lib} | {name} ({len(tok)}) | {setup * 1e3:.0f} | {compile_s * 1e3:.1f} | {per_token * 1e6:.1f} |",
                      flush=True)


if __name__ == "__main__":
    main()
