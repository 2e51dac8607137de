"""What bounding a JSON schema's numbers costs (serving.engine.json_grammar), and why strings are
not bounded: xgrammar's compile time and compiled size, and the mask + advance per token of a
document's walk, for the library's grammar and the bounded one, at a real vocabulary's size (the
byte-level BPE of bench/grammar_libraries.py, trained here), one thread. Then the two bounded
string forms xgrammar 0.2.8 offers, a repetition of a character class and of a character rule,
which docs/tools-and-structured-output.md, "Bounded JSON", quotes.

    python bench/json_grammar_bounds.py [--vocab 128000] [--string-chars 256]

Figures only (no assertion): the tokenizer takes about a minute to train on the 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grammar_libraries import DOCUMENT, SCHEMA, large_tokenizer  # noqa: E402

from serving.engine.json_grammar import json_schema_grammar  # noqa: E402

# The document each schema's walk writes: compact JSON as the grammar writes it (", " and ": ").
CASES = [
    ("order (bench/grammar_libraries.py)", SCHEMA, json.dumps(json.loads(DOCUMENT))),
    ('{"type": "number"}', {"type": "number"}, "-123456789012345.123456789012345e-123"),
    ("json_object", {"type": "object"}, '{"a": [1, "b", {"c": 123456789.25}], "d": null}'),
]
_ESCAPE = 'basic_escape ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))\n'


def walk(compiler: xgr.GrammarCompiler, ebnf: str, token_ids: list[int], vocab_size: int,
         budget_s: float = 30.0) -> tuple[float, int, float, int]:
    """(compile ms, compiled bytes, mask + advance µs a token, tokens walked before `budget_s`)."""
    start = time.perf_counter()
    compiled = compiler.compile_grammar(ebnf)
    compile_ms = (time.perf_counter() - start) * 1000
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab_size)
    start = time.perf_counter()
    walked = 0
    for token in token_ids:
        matcher.fill_next_token_bitmask(mask, 0)
        if not matcher.accept_token(token):
            raise AssertionError(f"the grammar refused token {token} of the document")
        walked += 1
        if time.perf_counter() - start > budget_s:
            break
    return compile_ms, compiled.memory_size_bytes, (time.perf_counter() - start) / walked * 1e6, walked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=128_000)
    parser.add_argument("--string-chars", type=int, default=256)
    args = parser.parse_args()
    start = time.perf_counter()
    tokenizer = large_tokenizer(args.vocab)
    print(f"tokenizer: {len(tokenizer):,} tokens, trained in {time.perf_counter() - start:.0f} s")
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    print("| schema | grammar | compile ms | compiled bytes | mask + advance µs/token |")
    print("| --- | --- | --- | --- | --- |")
    for name, schema, document in CASES:
        text = json.dumps(schema)
        ids = tokenizer(document, add_special_tokens=False).input_ids
        for label, ebnf in (("library", str(xgr.Grammar.from_json_schema(text, any_whitespace=False))),
                            ("bounded", json_schema_grammar(text))):
            compile_ms, size, per_token, _ = walk(compiler, ebnf, ids, info.vocab_size)
            print(f"| {name} | {label} | {compile_ms:.1f} | {size:,} | {per_token:.1f} |")
    chars = args.string_chars
    # Half the bound's characters of text, the string left open (the walk stays inside it).
    ids = tokenizer(json.dumps(("hello world " * chars)[:chars // 2])[:-1], add_special_tokens=False).input_ids
    print(f"\nA string bounded to {chars} characters, walked over {len(ids)} tokens of its text (30 s at most):")
    print("| form | compile ms | compiled bytes | mask + advance µs/token | tokens walked |")
    print("| --- | --- | --- | --- | --- |")
    forms = {
        "character class repeated": f'root ::= "\\"" [^\\0-\\x1f\\"\\\\]{{0, {chars}}} "\\""\n',
        "character rule repeated": (f'root ::= "\\"" c{{0, {chars}}} "\\""\n'
                                    f'c ::= ([^\\0-\\x1f\\"\\\\]) | ("\\\\" basic_escape)\n{_ESCAPE}'),
    }
    for label, ebnf in forms.items():
        compile_ms, size, per_token, walked = walk(compiler, ebnf, ids, info.vocab_size)
        print(f"| {label} | {compile_ms:.1f} | {size:,} | {per_token:.1f} | {walked} |")


if __name__ == "__main__":
    main()
