"""Load generator for the serving worker, in the shape of vLLM's `benchmark_serving.py`.

Requests go to `/v1/completions` as streams, each for a random adapter among N (or the base, for
`--base-fraction` of them), with prompt and output lengths drawn uniformly from
`len * [1 - ratio, 1 + ratio]` (vLLM's random dataset; prompts are random token ids, output lengths
are forced with `ignore_eos`). Arrivals are Poisson at `--request-rate` (or all at once with
`inf`), optionally capped at `--max-concurrency` in flight. Reported as vLLM reports them: request
and token throughput; TTFT (to the first token), TPOT (per output token after the first), ITL
(between token-bearing chunks) and end-to-end latency, mean / median / p99, in ms.

Against a running worker:

    python bench/serve.py --base-url http://127.0.0.1:8100 --model BASE --adapters a0 a1 …

or start one (tiny model on CPU; the Llama-3-8B shape with random weights on CUDA):

    python bench/serve.py --launch tiny --num-adapters 8 --num-prompts 200 --request-rate 8
    python bench/serve.py --launch llama3-8b --num-adapters 32 --num-prompts 500 --request-rate 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
sys.path[0] = str(ROOT)
# Token ids below this are special tokens in the tiny tokenizer; prompts avoid them.
_FIRST_PLAIN_ID = 16


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int,
                      run_start: float | None = None) -> Result:
    body = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }
    start = time.perf_counter()
    last = None
    result = Result(ok=False, prompt_tokens=len(prompt))
    # For a failure's message: when the request was written and how far its response got.
    chunks, sent = -1, None

    async def trace(event: str, info: dict) -> None:
        nonlocal sent
        if event == "http11.send_request_body.complete":
            sent = time.perf_counter() - start

    try:
        async with client.stream("POST", "/v1/completions", json=body, extensions={"trace": trace}) as response:
            chunks = 0
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                chunks += 1
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        got = "before the response's headers" if chunks < 0 else f"after {chunks} events"
        began = "" if run_start is None else f", begun {start - run_start:.1f}s into the run"
        wrote = "unsent" if sent is None else f"sent at {sent:.1f}s"
        result.error = f"{exc!r} {got}, {time.perf_counter() - start:.1f}s in ({wrote}){began}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = last is not None
    return result


async def run_load(args: argparse.Namespace) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.random_range_ratio)), int(mean * (1 + args.random_range_ratio))))

    requests = []
    for _ in range(args.num_prompts):
        prompt = [rng.randrange(_FIRST_PLAIN_ID, args.vocab_size) for _ in range(length(args.random_input_len))]
        use_base = not args.adapters or rng.random() < args.base_fraction
        model = args.model if use_base else rng.choice(args.adapters)
        requests.append((model, prompt, length(args.random_output_len)))
    # A fresh connection per request, as vLLM's benchmark_serving has (a session per request): a
    # kept-alive one races the worker's keep-alive timeout (uvicorn's 5 s). At 256 streams on a
    # few cores this process's event loop lags seconds between taking an idle connection from the
    # pool and writing on it, so the worker had closed it meanwhile and about one request in 1,000
    # failed with ReadError('') before any response (docs/benchmarks.md).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits, headers=_auth(args)) as client:
        # Warm-up (kernel compilation, first slot loads) is not measured.
        await asyncio.gather(*(one_request(client, m, p[:32], 4) for m, p, _ in requests[: args.warmup]))
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else contextlib.nullcontext()

        async def limited(model: str, prompt: list[int], output_len: int) -> Result:
            async with gate:
                return await one_request(client, model, prompt, output_len, start)

        tasks = []
        start = time.perf_counter()
        for model, prompt, output_len in requests:
            tasks.append(asyncio.create_task(limited(model, prompt, output_len)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return results, duration


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    summary: dict[str, float] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output / duration,
        "total_token_throughput": (output + prompt) / duration,
        "total_output_tokens": output,
        "total_input_tokens": prompt,
    }
    series = {
        "ttft": [r.ttft for r in done],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.e2e for r in done],
    }
    for name, values in series.items():
        if values:
            ordered = sorted(values)
            summary[f"mean_{name}_ms"] = statistics.fmean(values) * 1000
            summary[f"median_{name}_ms"] = statistics.median(values) * 1000
            summary[f"p99_{name}_ms"] = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000
    return summary


def print_summary(summary: dict[str, float], args: argparse.Namespace) -> None:
    print("=" * 18 + " Serving Benchmark Result " + "=" * 18)
    print(f"{'Adapters (random per request)':<40}{len(args.adapters):>12}")
    print(f"{'Successful requests':<40}{summary['completed']:>12}")
    print(f"{'Failed requests':<40}{summary['failed']:>12}")
    print(f"{'Benchmark duration (s)':<40}{summary['duration_s']:>12.2f}")
    print(f"{'Total input tokens':<40}{summary['total_input_tokens']:>12}")
    print(f"{'Total generated tokens':<40}{summary['total_output_tokens']:>12}")
    print(f"{'Request throughput (req/s)':<40}{summary['request_throughput']:>12.2f}")
    print(f"{'Output token throughput (tok/s)':<40}{summary['output_token_throughput']:>12.2f}")
    print(f"{'Total token throughput (tok/s)':<40}{summary['total_token_throughput']:>12.2f}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        if f"mean_{name}_ms" in summary:
            print(f"{'-' * 15}{title:^32}{'-' * 15}")
            for stat in ("mean", "median", "p99"):
                print(f"{f'{stat.capitalize()} {name.upper()} (ms)':<40}{summary[f'{stat}_{name}_ms']:>12.2f}")
    print("=" * 62)


# ---- launching a worker -------------------------------------------------------------------------


def _bench_engine():
    """bench/engine.py, for its Llama-3-8B config and its fast random adapter writer."""
    spec = importlib.util.spec_from_file_location("bench_engine", ROOT / "bench" / "engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def prepare(shape: str, num_adapters: int, rank: int, work: Path) -> tuple[Path, list[Path], list[str], int]:
    """A model directory, adapters on it, extra worker flags and the vocabulary size."""
    from serving.engine.tiny import build_tiny_model, save_random_peft_adapter

    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    if shape in ("tiny", "small"):
        model = build_tiny_model(work / f"{shape}-llama", arch="llama", size=shape)
        adapters = [save_random_peft_adapter(model, work / f"a{i}", r=rank, lora_alpha=2 * rank,
                                             target_modules=modules, seed=i) for i in range(num_adapters)]
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        return model, adapters, [], vocab
    engine_bench = _bench_engine()
    model = work / "llama3-8b-shape"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(engine_bench.LLAMA3_8B))
    # Any tokenizer will do: prompts are token ids; unknown ids decode to nothing.
    tiny = build_tiny_model(work / "tokenizer-source", arch="llama", size="tiny")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, model / name)
    adapters = [engine_bench._write_random_adapter(work / f"a{i}", engine_bench.LLAMA3_8B, rank, seed=i)
                for i in range(num_adapters)]
    return model, adapters, ["--load-format", "dummy"], engine_bench.LLAMA3_8B["vocab_size"]


@contextlib.contextmanager
def launched_worker(args: argparse.Namespace) -> Iterator[subprocess.Popen]:
    scratch = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="bench-serve-", dir=scratch) as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        model, adapters, extra, vocab = prepare(args.launch, args.num_adapters, args.rank, work)
        args.vocab_size = vocab
        args.adapters = [f"a{i}" for i in range(len(adapters))]
        print(f"prepared {args.launch} model and {len(adapters)} adapters in {time.perf_counter() - started:.1f}s",
              flush=True)
        port = 8100 + random.Random().randrange(500)
        args.base_url = f"http://127.0.0.1:{port}"
        command = [
            sys.executable, "-m", "serving.engine.server", "--model", str(model), "--port", str(port),
            "--served-model-name", args.model, "--max-loras", str(max(args.max_loras, 1)),
            "--max-cpu-loras", str(max(len(adapters), args.max_loras, 1)), "--max-lora-rank", str(args.rank),
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-queued-requests", str(args.num_prompts + args.warmup), "--uvicorn-log-level", "warning",
            *extra,
        ]
        if adapters:
            command += ["--lora-modules", *(f"a{i}={path}" for i, path in enumerate(adapters))]
        process = subprocess.Popen(command, cwd=ROOT)
        try:
            _wait_ready(args.base_url, process)
            print(f"worker ready after {time.perf_counter() - started:.1f}s", flush=True)
            yield process
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


# How the worker's py-spy samples are read (docs/benchmarks.md quotes these shares): the engine
# thread's by the first of these frames found in a sample's stack, the event loop's as busy unless
# its innermost frame is the loop's wait.
_ENGINE_SHARES = [
    ("idle", ("Condition.wait", "Event.wait")),
    ("sampler (waits for the GPU)", ("Sampler.__call__",)),
    ("replay host work", ("DecodeGraphs.replay",)),
    ("detokenize", ("detokenizer", "decode_text")),
    ("flat step layout", ("flat_step",)),
    ("eager forward, LoRA prepare", ("ModelRunner.execute",)),
    ("schedule", ("Scheduler.schedule",)),
    ("deliver outputs", ("_deliver", "call_soon")),
    ("rest of the step", ("LLMEngine.step",)),
]


def sample_shares(path: Path) -> dict[str, dict[str, float]]:
    """Per thread of a raw py-spy file (``--threads --idle``): the share of its samples by kind."""
    counts: dict[str, dict[str, int]] = {}
    for line in path.read_text().splitlines():
        stack, _, number = line.rpartition(" ")
        frames = stack.split(";")
        if len(frames) < 2:
            continue
        thread = frames[1].rpartition(": ")[2]
        if thread == "engine-core":
            joined = ";".join(frames[2:])
            kind = next((name for name, marks in _ENGINE_SHARES if any(m in joined for m in marks)), "other")
        elif thread == "MainThread":
            kind = "idle" if any(m in frames[-1] for m in ("Runner.run", "select")) else "busy"
        else:
            continue
        counts.setdefault(thread, {})
        counts[thread][kind] = counts[thread].get(kind, 0) + int(number)
    return {t: {k: n / sum(c.values()) for k, n in sorted(c.items(), key=lambda kv: -kv[1])} for t, c in counts.items()}


@contextlib.contextmanager
def sampled(out: Path, processes: dict[str, subprocess.Popen | None], rate: float) -> Iterator[None]:
    """py-spy samples of each process (None: this one, the load generator) while the block runs.

    Raw (collapsed) stacks per thread with idle samples kept, so a thread's busy share and where it
    goes can be read off the file (`grep -c`), for the worker's engine thread and event loop alike.
    """
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, process in processes.items():
        pid = process.pid if process is not None else os.getpid()
        # A worker's children (an engine core of its own, say) are sampled with it; this process's
        # children are the worker itself, sampled on its own.
        children = ["--subprocesses"] if process is not None else []
        command = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--idle", "--threads", *children,
                   "--rate", "200", "-o", str(out / f"py-spy-{name}-{rate:g}.txt")]
        spies.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    try:
        yield
    finally:
        for spy in spies:  # py-spy writes its file on SIGINT
            spy.send_signal(signal.SIGINT)
        for spy in spies:
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                err = b"timed out"
            if spy.returncode:
                print(f"py-spy exited with {spy.returncode}: {err.decode(errors='replace')[-500:]}", flush=True)
        worker_file = out / f"py-spy-worker-{rate:g}.txt"
        if worker_file.exists():
            for thread, shares in sample_shares(worker_file).items():
                print(f"worker {thread}: " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()), flush=True)


def _wait_ready(base_url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the worker exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit("the worker did not get ready")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8100")
    p.add_argument("--model", default="base", help="the base model's served name")
    p.add_argument("--adapters", nargs="*", default=[], help="adapter names to spread requests over")
    p.add_argument("--api-key", default=None)
    p.add_argument("--base-fraction", type=float, default=0.0, help="share of requests for the base model")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument(
        "--request-rate", default="inf",
        help="Poisson arrivals per second; a comma-separated list runs each rate in turn on the same worker (a curve)",
    )  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.25)
    p.add_argument("--vocab-size", type=int, default=256, help="prompt token ids are drawn below this")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    launch = p.add_argument_group("launching a worker (--launch)")
    launch.add_argument("--launch", choices=["tiny", "small", "llama3-8b"], default=None)
    launch.add_argument("--num-adapters", type=int, default=8)
    launch.add_argument("--rank", type=int, default=16)
    launch.add_argument("--max-loras", type=int, default=None, help="GPU slots (default: --num-adapters)")
    launch.add_argument("--max-num-seqs", type=int, default=256)
    # The worker's own default: a larger budget lets a burst of prompts make steps over the
    # captured ladder (max_flat_tokens, 2048), which run eagerly and stall every decode meanwhile.
    launch.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--py-spy-dir", type=Path, default=None,
                   help="sample the worker (--launch) and this load generator with py-spy during the last rate")
    args = p.parse_args()
    if args.py_spy_dir is not None and not args.launch:
        p.error("--py-spy-dir samples a launched worker: it needs --launch")
    try:
        rates = [float(rate) for rate in args.request_rate.split(",")]
    except ValueError:
        p.error(f"--request-rate takes numbers (or inf), comma-separated; got {args.request_rate!r}")
    if args.max_loras is None:
        args.max_loras = args.num_adapters
    summaries = []
    with launched_worker(args) if args.launch else contextlib.nullcontext() as worker:
        for i, rate in enumerate(rates):
            args.request_rate = rate
            profiled = args.py_spy_dir is not None and i == len(rates) - 1
            with sampled(args.py_spy_dir, {"worker": worker, "client": None}, rate) if profiled else contextlib.nullcontext():
                results, duration = asyncio.run(run_load(args))
            summary = {"request_rate": rate, **summarize(results, duration)}
            print(f"request rate {rate} req/s")
            print_summary(summary, args)
            for error in sorted({r.error for r in results if not r.ok})[:5]:
                print(f"error: {error}")
            summaries.append(summary)
    if len(summaries) > 1:
        print(f"{'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'ok':>5}")
        for s in summaries:
            print(f"{s['request_rate']:>7g} {s['output_token_throughput']:>10.1f} {s.get('median_ttft_ms', 0):>9.1f} "
                  f"{s.get('p99_ttft_ms', 0):>9.1f} {s.get('median_tpot_ms', 0):>9.1f} {s['completed']:>5}")
    if args.json:
        record = {"args": {k: v for k, v in vars(args).items() if k not in ("api_key", "json")},
                  "host": platform.node(), "python": platform.python_version(),
                  **(summaries[0] if len(summaries) == 1 else {"runs": summaries})}
        args.json.write_text(json.dumps(record, indent=2, default=str))
    return 0 if all(s["completed"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
