"""`n` completions of one prompt against `n` requests of it (issue 24, item 3's measure: n = 4 costs
one prefill, not four).

One engine, the ``small`` tiny model (hidden 512, 8 layers) built on the spot, fp32, on the CPU
(or ``--device cuda``). Two ways to get ``--n`` sampled completions of one ``--prompt-tokens``
prompt, each run to ``--max-tokens`` (``ignore_eos``), alternated ``--repeats`` times:

- ``n requests``: ``--n`` requests of the same prompt at once, each prefilled on its own;
- ``one request, n``: ``SamplingParams(n=...)``: one prefill, the others forked after it.

Reported per way: the prompt tokens the engine computed (``EngineStats.prefill_tokens``), the
steps, the peak of KV blocks in use, and the wall time to the last token (median over repeats).

    python bench/n_completions.py [--n 4] [--prompt-tokens 1024] [--max-tokens 32] [--repeats 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from serving.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from serving.engine.tiny import build_tiny_model  # noqa: E402

from bench.card import card  # noqa: E402


def run_once(engine: LLMEngine, prompt: list[int], args: argparse.Namespace, *, forked: bool, tag: str
             ) -> dict[str, float]:
    before = engine.stats()
    params = SamplingParams(n=args.n if forked else 1, temperature=1.0, seed=7, max_tokens=args.max_tokens,
                            ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(1 if forked else args.n)]
    start = time.perf_counter()
    for request_id in ids:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    steps = peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, engine.block_manager.num_used_blocks)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    after = engine.stats()
    return {
        "prefill_tokens": after.prefill_tokens - before.prefill_tokens,
        "generation_tokens": after.generation_tokens - before.generation_tokens,
        "steps": steps,
        "peak_kv_blocks": peak,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "small", size="small", seed=0)
        engine = LLMEngine(EngineConfig(model=str(model), max_loras=0, device=args.device, seed=0,
                                        max_model_len=args.prompt_tokens + args.max_tokens + 16,
                                        max_num_batched_tokens=2048, max_num_seqs=max(args.n, 8)))
        vocab = engine.hf_config.vocab_size
        generator = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, vocab, (args.prompt_tokens,), generator=generator).tolist()
        runs: dict[str, list[dict[str, float]]] = {"n requests": [], "one request, n": []}
        run_once(engine, prompt, args, forked=True, tag="warm")  # first-step costs out of the timings
        for repeat in range(args.repeats):
            runs["n requests"].append(run_once(engine, prompt, args, forked=False, tag=f"sep{repeat}"))
            runs["one request, n"].append(run_once(engine, prompt, args, forked=True, tag=f"fork{repeat}"))
        engine.shutdown()
    summary = {way: {key: statistics.median(r[key] for r in results) for key in results[0]}
               for way, results in runs.items()}
    print(f"n={args.n}, prompt {args.prompt_tokens} tokens, {args.max_tokens} tokens each, {args.device}, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"{'way':<16} {'prefill tokens':>15} {'generated':>10} {'steps':>6} {'peak KV blocks':>15} {'seconds':>8}")
    for way, row in summary.items():
        print(f"{way:<16} {row['prefill_tokens']:>15.0f} {row['generation_tokens']:>10.0f} {row['steps']:>6.0f} "
              f"{row['peak_kv_blocks']:>15.0f} {row['seconds']:>8.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "card": card(),
                                         "runs": runs, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
