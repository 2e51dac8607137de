"""Starting a serving worker for bench/serve.py's --launch: a tiny model on CPU or the Llama-3-8B
shape with random weights (--load-format dummy; with --awq-base a random AWQ INT4 checkpoint written
by bench/awq_checkpoint.py), adapters written for it, the worker ready."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.random_adapters import MODULE_SETS, adapter_bytes, adapter_set, scratch_root, shape_config

ROOT = Path(__file__).resolve().parent.parent
_AWQ_8B_BYTES = 6 * 10**9  # bench/awq_checkpoint.py's 8B shape: 5.7 GB


def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, list[Path], list[str], int, dict[str, Any]]:
    """A model directory, adapters on it (from --adapter-cache where given, written in parallel where
    missing), extra worker flags, the vocabulary size and what preparing took."""
    from serving.engine.tiny import build_tiny_model

    config = shape_config(args.launch)
    if args.launch in ("tiny", "small"):
        model = build_tiny_model(work / f"{args.launch}-llama", arch="llama", size=args.launch)
        extra: list[str] = []
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    elif getattr(args, "awq_base", False):
        from bench.awq_checkpoint import write_random_awq

        model = write_random_awq(work / f"{args.launch}-awq", args.launch, group_size=128, seed=0)
        extra, vocab = [], config["vocab_size"]
    else:
        model = work / "llama3-8b-shape"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(config))
        # Any tokenizer will do: prompts are token ids; unknown ids decode to nothing.
        tiny = build_tiny_model(work / "tokenizer-source", arch="llama", size="tiny")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (tiny / name).exists():
                shutil.copy(tiny / name, model / name)
        extra, vocab = ["--load-format", "dummy"], config["vocab_size"]
    root = args.adapter_cache or work / "adapters"
    started = time.perf_counter()
    adapters, written = adapter_set(root, args.launch, count=args.num_adapters, rank=args.rank,
                                    modules=args.adapter_modules)
    size = adapter_bytes(config, args.rank, MODULE_SETS[args.adapter_modules])
    info = {"adapter_root": str(root), "adapters_written": written, "adapter_mb": size / 1e6,
            "adapters_write_s": time.perf_counter() - started}
    print(f"adapters: {written} of {len(adapters)} written now ({size / 1e6:.2f} MB each, rank {args.rank} on "
          f"{args.adapter_modules} projections) in {info['adapters_write_s']:.1f}s under {root}", flush=True)
    return model, adapters, extra, vocab, info


@dataclass
class Launched:
    process: subprocess.Popen[bytes]
    info: dict[str, Any]  # what preparing and starting took, where the adapters are
    model: Path = Path()  # the model directory the worker serves
    adapter_dirs: list[Path] = field(default_factory=list)  # adapter a<i> is the i-th


@contextlib.contextmanager
def launched_worker(args: argparse.Namespace, *, worker_flags: Sequence[str] = (),
                    preload: bool = True) -> Iterator[Launched]:
    """The worker, ready. ``worker_flags`` go on its command line; without ``preload`` its adapters
    are not named on it (--lora-modules), so it serves them only as requests bring them
    (bench/serve_gateway.py: as the registry's versions, loaded on their first request)."""
    # The adapters go in the work directory unless cached elsewhere: it is on /dev/shm if they fit.
    one = adapter_bytes(shape_config(args.launch), args.rank, MODULE_SETS[args.adapter_modules])
    need = 0 if args.adapter_cache else args.num_adapters * one
    if getattr(args, "awq_base", False):
        need += _AWQ_8B_BYTES  # the checkpoint goes in the same directory
    with tempfile.TemporaryDirectory(prefix="bench-serve-", dir=scratch_root(need)) as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        model, adapters, extra, vocab, info = prepare(args, work)
        args.vocab_size = vocab
        args.adapters = [f"a{i}" for i in range(len(adapters))]
        info["prepare_s"] = time.perf_counter() - started
        print(f"prepared {args.launch} model and {len(adapters)} adapters in {info['prepare_s']:.1f}s", flush=True)
        port = 8100 + random.Random().randrange(500)
        args.base_url = f"http://127.0.0.1:{port}"
        command = [
            sys.executable, "-m", "serving.engine.server", "--model", str(model), "--port", str(port),
            "--served-model-name", args.model, "--max-cpu-loras", str(max(len(adapters), args.max_loras, 1)),
            "--max-lora-rank", str(args.rank), "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-queued-requests", str(args.num_prompts + args.warmup), "--uvicorn-log-level", "warning",
            *extra, *worker_flags, *shlex.split(getattr(args, "worker_args", "")),
        ]
        # 0: the worker's own default (how it sizes adapter memory unasked).
        if args.max_loras:
            command += ["--max-loras", str(args.max_loras)]
        if args.lora_memory_bytes is not None:
            command += ["--lora-memory-bytes", str(args.lora_memory_bytes)]
        if adapters and preload:
            command += ["--lora-modules", *(f"a{i}={path}" for i, path in enumerate(adapters))]
        # The worker's access lines (one a request, at INFO) stay out of the output and off its event
        # loop, as uvicorn's did under --uvicorn-log-level warning.
        process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "LOG_LEVEL": "WARNING"})
        try:
            wait_ready(args.base_url, process)
            info["ready_s"] = time.perf_counter() - started - info["prepare_s"]
            print(f"worker ready after {time.perf_counter() - started:.1f}s ({info['ready_s']:.1f}s to start)", flush=True)
            yield Launched(process, info, model, adapters)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()


def wait_ready(base_url: str, process: subprocess.Popen, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the worker exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise SystemExit("the worker did not get ready")
