"""The serving worker's event-loop CPU per streamed token: how much of one core the worker's HTTP
side (the ASGI app, the SSE rendering, the generation's async hops, uvicorn's sends) spends for
each token it streams, apart from the engine thread's compute.

Starts a worker on the tiny model (CPU), streams `--requests` completions `--concurrency` at a time
at A and B tokens a reply (`ignore_eos`, so every reply has exactly that many), and reads the CPU
time of the worker's main thread, where uvicorn's event loop runs (its thread id is the process
id), from /proc before and after each phase. The slope between A and B is the loop's CPU per
streamed token, the intercept its CPU per request. On the H200 the loop was the busiest thread
beside the engine's at 64 req/s (docs/benchmarks.md, "The 64 req/s gap, profiled"), so this is the
figure that bounds the worker's request rate from the HTTP side, measurable without a GPU.

    python bench/worker_loop_cpu.py [--requests 200] [--concurrency 16] [--tokens 8 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# Run as a script, this file's folder heads sys.path; the repository root must be there instead.
ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)

from bench.gateway import free_port, wait_up  # noqa: E402

# /proc's CPU times are in clock ticks.
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int, tid: int) -> float:
    """User + system CPU seconds of thread `tid` of process `pid`."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: state is field 3 of stat(5), utime 14 and stime 15.
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


async def stream_all(url: str, requests: int, concurrency: int, tokens: int) -> int:
    """Streams `requests` completions of `tokens` tokens, `concurrency` at a time; the chunks read."""
    body = {"model": "base", "prompt": "The quick brown fox", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    remaining = iter(range(requests))
    chunks = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def lane() -> None:
            nonlocal chunks
            for _ in remaining:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks += 1

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    return chunks


def measure(url: str, pid: int, requests: int, concurrency: int, tokens: int) -> dict[str, float]:
    """The main thread's and the whole process's CPU ms per request over one phase."""
    loop_before, all_before = thread_cpu_s(pid, pid), process_cpu_s(pid)
    started = time.perf_counter()
    chunks = asyncio.run(stream_all(url, requests, concurrency, tokens))
    wall = time.perf_counter() - started
    loop_ms = (thread_cpu_s(pid, pid) - loop_before) * 1000 / requests
    all_ms = (process_cpu_s(pid) - all_before) * 1000 / requests
    return {"tokens": tokens, "chunks_per_request": chunks / requests, "loop_ms_per_request": loop_ms,
            "process_ms_per_request": all_ms, "wall_s": wall}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, nargs=2, default=[8, 64], metavar=("A", "B"))
    parser.add_argument("--rounds", type=int, default=3, help="A and B phases alternated this many times")
    args = parser.parse_args()
    from serving.engine.tiny import build_tiny_model

    short, long = args.tokens
    with tempfile.TemporaryDirectory() as work:
        model = build_tiny_model(Path(work) / "tiny-llama", arch="llama", seed=0)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # One torch thread: the engine's compute stays on its own core, off the loop's.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        log = Path(work) / "worker.log"
        with log.open("wb") as output:
            worker = subprocess.Popen(
                [sys.executable, "-m", "serving.engine.server", "--model", str(model), "--port", str(port),
                 "--served-model-name", "base", "--device", "cpu", "--max-num-seqs", str(max(args.concurrency, 8)),
                 "--uvicorn-log-level", "warning"],
                cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            wait_up(f"{url}/health", log)
            measure(url, worker.pid, max(args.concurrency * 2, 20), args.concurrency, long)  # warm-up
            slopes, intercepts = [], []
            print(f"{platform.node()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
                  f"{args.requests} streamed requests a phase, {args.concurrency} at a time")
            print(f"{'round':>5} {'tokens':>6} {'chunks/req':>10} {'loop ms/req':>12} {'process ms/req':>15} {'wall s':>7}")
            for round_ in range(args.rounds):
                phases = {t: measure(url, worker.pid, args.requests, args.concurrency, t) for t in (short, long)}
                for t, f in phases.items():
                    print(f"{round_:>5} {t:>6} {f['chunks_per_request']:>10.1f} {f['loop_ms_per_request']:>12.3f} "
                          f"{f['process_ms_per_request']:>15.3f} {f['wall_s']:>7.1f}")
                slope = (phases[long]["loop_ms_per_request"] - phases[short]["loop_ms_per_request"]) / (long - short)
                slopes.append(slope)
                intercepts.append(phases[short]["loop_ms_per_request"] - slope * short)
            print(f"event-loop CPU per streamed token: median {statistics.median(slopes):.4f} ms "
                  f"(rounds: {', '.join(f'{s:.4f}' for s in slopes)}); per request at 0 tokens: "
                  f"{statistics.median(intercepts):.3f} ms")
        finally:
            worker.terminate()
            worker.wait(timeout=60)


if __name__ == "__main__":
    main()
