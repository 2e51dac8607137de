"""py-spy samples of the serving worker and the load generator while bench/serve.py runs
(--py-spy-dir), and the share of each thread's samples by kind (docs/benchmarks.md quotes them)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

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
