"""Prefix caching off against on (issue 22, item 1): requests that share a system prompt per adapter.

One engine, the ``small`` tiny model (hidden 512, 8 layers) built on the spot with ``--adapters``
random rank-8 adapters, fp32, on the CPU (or ``--device cuda``). Each adapter has its own
``--system-tokens`` system prompt; ``--requests`` requests, spread round-robin over the adapters,
are that system prompt and a question of ``--question-tokens`` of their own, each generating
``--max-tokens`` tokens (greedy, ``ignore_eos``). They are queued ``--wave`` at a time (the next wave
once the last finished), the same workload once with ``enable_prefix_caching`` off and once on,
alternated ``--repeats`` times, each on a fresh engine (an empty cache).

Reported per mode: the prompt tokens the engine computed (``EngineStats.prefill_tokens``), the
prefix cache's hit tokens and queried tokens, the steps, and the wall time to the last token
(median over repeats); and whether both modes generated the same tokens.

    python bench/prefix_cache.py [--adapters 4] [--requests 32] [--system-tokens 512] [--question-tokens 32]
                                 [--max-tokens 16] [--wave 8] [--repeats 3] [--json OUT]
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

from serving.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams  # noqa: E402
from serving.engine.tiny import build_tiny_model, save_random_peft_adapter  # noqa: E402

from bench.card import card  # noqa: E402


def workload(args: argparse.Namespace, vocab: int, adapters: list[Path]) -> list[tuple[list[int], LoRARequest]]:
    """``(prompt token ids, adapter)`` per request, the same for both modes."""
    generator = torch.Generator().manual_seed(0)
    systems = [torch.randint(3, vocab, (args.system_tokens,), generator=generator).tolist() for _ in adapters]
    requests = []
    for i in range(args.requests):
        k = i % len(adapters)
        question = torch.randint(3, vocab, (args.question_tokens,), generator=generator).tolist()
        requests.append((systems[k] + question, LoRARequest(f"adapter-{k}", str(adapters[k]))))
    return requests


def run(model: Path, requests: list[tuple[list[int], LoRARequest]], args: argparse.Namespace, *, caching: bool
        ) -> tuple[dict[str, float], list[list[int]]]:
    engine = LLMEngine(EngineConfig(model=str(model), device=args.device, seed=0, max_loras=args.adapters,
                                    max_lora_rank=8, max_num_seqs=args.wave,
                                    max_model_len=args.system_tokens + args.question_tokens + args.max_tokens + 16,
                                    enable_prefix_caching=caching))  # fmt: skip
    for k in range(args.adapters):  # adapters read from disk before the clock starts
        engine.add_lora(requests[k][1])
    while engine.lora_cache is not None and engine.lora_cache.num_loading:
        engine.step()
        engine.wait_for_loads(0.1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    steps = 0
    start = time.perf_counter()
    for first in range(0, len(requests), args.wave):
        for i, (prompt, lora) in enumerate(requests[first : first + args.wave], first):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, lora)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.error is not None:
                    raise output.error
                if output.finished:
                    tokens[output.request_id] = output.outputs[0].token_ids
            steps += 1
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stats = engine.stats()
    engine.shutdown()
    row = {"prefill_tokens": stats.prefill_tokens, "prefix_cache_hits": stats.prefix_cache_hits,
           "prefix_cache_queries": stats.prefix_cache_queries, "steps": steps, "seconds": seconds}
    return row, [tokens[f"r{i}"] for i in range(len(requests))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--wave", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs: dict[str, list[dict[str, float]]] = {"caching off": [], "caching on": []}
    outputs: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "small", size="small", seed=0)
        adapters = [save_random_peft_adapter(model, Path(tmp) / f"adapter-{k}", r=8, lora_alpha=16,
                                             target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=k)
                    for k in range(args.adapters)]  # fmt: skip
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        requests = workload(args, vocab, adapters)
        for _ in range(args.repeats):
            for mode in runs:
                row, outputs[mode] = run(model, requests, args, caching=mode == "caching on")
                runs[mode].append(row)
    summary = {mode: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for mode, rows in runs.items()}
    same = outputs["caching off"] == outputs["caching on"]
    print(f"{args.requests} requests over {args.adapters} adapters, system prompt {args.system_tokens} tokens per "
          f"adapter + {args.question_tokens}, {args.max_tokens} tokens each, waves of {args.wave}, {args.device}, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"{'mode':<12} {'prefill tokens':>15} {'cache hits':>11} {'queried':>8} {'steps':>6} {'seconds':>8}")
    for mode, row in summary.items():
        seconds = sorted(r["seconds"] for r in runs[mode])
        print(f"{mode:<12} {row['prefill_tokens']:>15.0f} {row['prefix_cache_hits']:>11.0f} "
              f"{row['prefix_cache_queries']:>8.0f} {row['steps']:>6.0f} {row['seconds']:>8.3f} "
              f"({seconds[0]:.3f}-{seconds[-1]:.3f})")
    print(f"same tokens with caching on and off: {same}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "card": card(), "runs": runs,
                                         "median": summary, "same_tokens": same}, indent=2))
    if not same:
        raise SystemExit("caching on generated other tokens than caching off")


if __name__ == "__main__":
    main()
