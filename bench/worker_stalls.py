"""How long `/health` takes to answer while a request that used to stall the worker runs
(docs/serving-worker.md, "What an operator must set", its last paragraph): a caller's chat template
looping 10,000 × 10,000 times (with --trust-request-chat-template, so it renders in the sandbox
until its deadline) and a prompt of about 900 KB (tokenized off the event loop). Starts a worker on
the tiny model, polls /health every 50 ms, prints the latencies.

    python bench/worker_stalls.py [--chat-template-timeout 5]
"""

from __future__ import annotations

import argparse
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

LOOP = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 20_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def health_latencies(url: str, request: httpx.Request | None) -> tuple[list[float], float, int | None]:
    """/health latencies (ms) while `request` runs (or for 3 s), its duration (s) and status."""
    outcome: dict[str, float | int] = {}

    def send() -> None:
        started = time.perf_counter()
        with httpx.Client(timeout=300) as client:
            outcome["status"] = client.send(request).status_code  # type: ignore[arg-type]
        outcome["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=send) if request is not None else None
    if thread is not None:
        thread.start()
        time.sleep(0.3)
    latencies, until = [], time.monotonic() + 3
    with httpx.Client(timeout=60) as client:
        while thread.is_alive() if thread is not None else time.monotonic() < until:
            started = time.perf_counter()
            client.get(f"{url}/health")
            latencies.append((time.perf_counter() - started) * 1000)
            time.sleep(0.05)
    if thread is not None:
        thread.join()
    return latencies, float(outcome.get("seconds", 0.0)), outcome.get("status")  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chat-template-timeout", type=float, default=5.0)
    args = parser.parse_args()
    from serving.engine.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as work:
        model = build_tiny_model(Path(work) / "tiny-llama", arch="llama", seed=0)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        worker = subprocess.Popen(
            [sys.executable, "-m", "serving.engine.server", "--model", str(model), "--port", str(port),
             "--served-model-name", "base", "--trust-request-chat-template",
             "--chat-template-timeout", str(args.chat_template_timeout), "--uvicorn-log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            httpx.post(f"{url}/v1/chat/completions", json={**chat, "chat_template": "{{ 'warm' }}"}, timeout=120)
            cases = {
                "idle": None,
                "caller template 10000x10000": httpx.Request(
                    "POST", f"{url}/v1/chat/completions", json={**chat, "chat_template": LOOP}),
                f"prompt of {len(PROMPT) // 1000} KB": httpx.Request(
                    "POST", f"{url}/v1/completions", json={"model": "base", "prompt": PROMPT, "max_tokens": 1}),
            }
            print(f"{platform.node()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}")
            print(f"{'while':32} {'request':>14} {'/health polls':>14} {'median ms':>10} {'max ms':>8}")
            for name, request in cases.items():
                latencies, seconds, status = health_latencies(url, request)
                took = f"{seconds:.1f}s -> {status}" if request is not None else "-"
                print(f"{name:32} {took:>14} {len(latencies):>14} {statistics.median(latencies):>10.1f} "
                      f"{max(latencies):>8.1f}")
        finally:
            worker.terminate()
            worker.wait(timeout=60)


if __name__ == "__main__":
    main()
