"""Tenant B's new small schema while tenant A's pathological one compiles (issue 37, item 2): the
time from B's request to its last token, on the offline engine (the tiny model on CPU), with A's
schema of objects nested `--depth` levels compiling beside it, against B alone.

The budget's nesting bound is raised so A's schema compiles (at the worker's defaults it is refused
before compiling); the pool is warmed first by an unrelated schema, as a serving worker's is. Run
at an older commit (PYTHONPATH pointing at its tree) it measures the single grammar thread that
came before (copy this script into that tree's bench/): there B waits for A's compile.

Then, on the pool alone (`--kill-timeout` seconds a compile): A's next compile after its last one
was killed past its time, which waits for the killed process's replacement (A's share holds it):
the start of a compiling process, as a tenant whose compiles keep timing out pays it each time.

    python bench/grammar_pool.py [--depth 400] [--repeat 3] [--kill-timeout 0.5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving.engine import LLM, SamplingParams  # noqa: E402
from serving.engine.grammar_pool import GrammarBudget, GrammarPool  # noqa: E402
from serving.engine.guided import GuidedDecodingParams  # noqa: E402
from serving.engine.tiny import build_tiny_model  # noqa: E402


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def small(tag: str) -> GuidedDecodingParams:
    """A schema no tenant has sent before (its property name differs per call)."""
    return GuidedDecodingParams(json={"type": "object", "properties": {tag: {"type": "boolean"}}, "required": [tag]})


def run_until(llm: LLM, request_id: str) -> None:
    engine = llm.llm_engine
    while True:
        if any(out.request_id == request_id and out.finished for out in engine.step()):
            return
        time.sleep(0.001)


def b_latency(llm: LLM, tag: str, *, constrained: bool = True) -> float:
    engine = llm.llm_engine
    prompt = engine.encode("Hello")[1]
    start = time.perf_counter()
    engine.add_request(f"b-{tag}", {"prompt_token_ids": prompt, "cache_salt": "tenant-b"},
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=not constrained,
                                      guided_decoding=small(tag) if constrained else None))
    run_until(llm, f"b-{tag}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kill-timeout", type=float, default=0.5)
    args = parser.parse_args()
    kwargs: dict[str, Any] = {"grammar": GrammarBudget(timeout=600.0, max_schema_depth=10_000)}
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(build_tiny_model(Path(tmp) / "tiny")), device="cpu", max_loras=0, max_model_len=256,
                  num_kv_blocks=64, **kwargs)
        engine = llm.llm_engine
        b_latency(llm, "warm")  # the pool's processes started, the tokenizer's table built
        free = [b_latency(llm, f"free{i}", constrained=False) for i in range(args.repeat)]
        alone = [b_latency(llm, f"alone{i}") for i in range(args.repeat)]
        prompt = engine.encode("Hello")[1]
        a_start = time.perf_counter()
        engine.add_request("a", {"prompt_token_ids": prompt, "cache_salt": "tenant-a"},
                           SamplingParams(max_tokens=8, guided_decoding=GuidedDecodingParams(json=nested(args.depth))))
        beside = [b_latency(llm, f"beside{i}") for i in range(args.repeat)]
        a_running = time.perf_counter() - a_start
        print(f"B alone without a schema (8 tokens): {', '.join(f'{s:.3f}' for s in free)} s")
        print(f"B alone (new small schema, 8 tokens): {', '.join(f'{s:.3f}' for s in alone)} s")
        print(f"B while A's {args.depth}-level schema compiles: {', '.join(f'{s:.3f}' for s in beside)} s "
              f"(A had been compiling {a_running:.1f} s when B's last ended)")
        engine.abort_request("a")
        tokenizer = engine.tokenizer
        engine.shutdown()
        print(f"A's next compile after its last was killed past {args.kill_timeout:g} s: "
              f"{', '.join(f'{s:.3f}' for s in after_kill(tokenizer, args))} s")


def after_kill(tokenizer: Any, args: argparse.Namespace) -> list[float]:
    """Seconds from A's killed compile's answer to A's next (small) compile's."""
    import xgrammar as xgr

    pool = GrammarPool(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer),
                       GrammarBudget(timeout=args.kill_timeout, max_schema_depth=10_000))
    try:
        pool.submit("B", "json", json.dumps({"type": "object"}), "JSON schema").result()  # the pool started
        times = []
        for i in range(args.repeat):
            pool.submit("A", "json", json.dumps(nested(args.depth)), "JSON schema").exception()  # killed
            start = time.perf_counter()
            pool.submit("A", "json", str(small(f"k{i}").json), "JSON schema").result()
            times.append(time.perf_counter() - start)
        return times
    finally:
        pool.close()


if __name__ == "__main__":
    main()
