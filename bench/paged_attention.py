"""One layer's paged attention (kernels.paged_attention) on one CUDA GPU, as a flat step calls it
(``row_seq`` given), at the Llama-3-8B shape: 32 query and 8 KV heads of 128, bf16, pages of 16.

Cases: decode batches (one row per sequence), a prefill of four fresh prompts (runs of rows, the
runs kernel's work) and a mixed step (decodes and one prompt chunk). Each is timed as a CUDA graph
of 32 back-to-back calls, replayed ``--repeats`` times: microseconds a call, with no launch gaps
but the graph's own. Nothing is asserted.

``--sweep`` also times the runs kernel's tile (query rows, key block, stages) and the decode
kernel's warps and stages over the cases they serve, one line each, then the fastest: the figures
to set ``RUN_TILE_ROWS``, ``RUN_BLOCK_N``, ``RUN_STAGES``, ``DECODE_WARPS`` and ``DECODE_STAGES``
from. To compare with an older kernel, put its ``kernels/paged_attention.py`` back and run again.

    python bench/paged_attention.py [--context 512] [--sweep] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from bench.card import card  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
CALLS_PER_GRAPH = 32


def time_call(fn: Callable[[], object], repeats: int) -> float:
    """Microseconds a call of ``fn``, from a CUDA graph of ``CALLS_PER_GRAPH`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats / CALLS_PER_GRAPH * 1e6


def cases(context: int) -> dict[str, list[tuple[int, int]]]:
    """Each case's rows as (sequence, position)."""
    last = context - 1
    return {
        "decode 64": [(s, last) for s in range(64)],
        "decode 256": [(s, last) for s in range(256)],
        f"prefill 4 x {context}": [(s, p) for s in range(4) for p in range(context)],
        "mixed 63 + 256": [(s, last) for s in range(63)] + [(63, p) for p in range(256)],
    }


def build(rows: list[tuple[int, int]], k_cache: torch.Tensor, v_cache: torch.Tensor) -> Callable[[], object]:
    """The call of one case, on random pages and queries."""
    device = k_cache.device
    num_seqs = max(seq for seq, _ in rows) + 1
    width = max(pos for _, pos in rows) // PAGE + 1
    tables = torch.randperm(k_cache.shape[0], device=device)[: num_seqs * width].view(num_seqs, width)
    row_seq = torch.tensor([seq for seq, _ in rows], device=device)
    lens = torch.tensor([pos + 1 for _, pos in rows], device=device)
    q = torch.randn(len(rows), HEADS, HEAD_DIM, device=device, dtype=k_cache.dtype)
    out = torch.empty_like(q)
    splits = pa.decode_splits(len(rows), KV_HEADS, int(lens.max()))

    def call() -> object:
        return pa.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=HEAD_DIM**-0.5,
                                         num_splits=splits, out=out, row_seq=row_seq)  # fmt: skip

    return call


def sweep(calls: dict[str, Callable[[], object]], names: list[str], setter: Callable[..., None],
          configs: list[tuple[int, ...]], repeats: int) -> tuple[int, ...]:  # fmt: skip
    """Time ``names`` under each config (``setter(*config)``); keep and return the fastest total."""
    best: tuple[float, tuple[int, ...]] | None = None
    for config in configs:
        setter(*config)
        times = [time_call(calls[name], repeats) for name in names]
        total = sum(times)
        print(f"  {config}: " + ", ".join(f"{n} {t:.1f} us" for n, t in zip(names, times)) + f" (sum {total:.1f})")
        if best is None or total < best[0]:
            best = (total, config)
    assert best is not None
    setter(*best[1])
    return best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=512, help="decodes' context and the prompts' length")
    parser.add_argument("--repeats", type=int, default=30, help="graph replays a timing")
    parser.add_argument("--sweep", action="store_true", help="also time the kernels' launch parameters")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/paged_attention.py times the Triton kernels on a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    pages = 16384
    k_cache = torch.randn(pages, PAGE, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    calls = {name: build(rows, k_cache, v_cache) for name, rows in cases(args.context).items()}
    figures: dict[str, object] = {"card": card(), "context": args.context}
    for name, call in calls.items():
        figures[f"{name} us"] = micros = time_call(call, args.repeats)
        print(f"{name:>18}: {micros:8.1f} us")
    if args.sweep:
        prefill, mixed = f"prefill 4 x {args.context}", "mixed 63 + 256"

        def set_runs(rows: int, block_n: int, stages: int) -> None:
            pa.RUN_TILE_ROWS, pa.RUN_BLOCK_N, pa.RUN_STAGES = rows, block_n, stages

        def set_decode(warps: int, stages: int) -> None:
            pa.DECODE_WARPS, pa.DECODE_STAGES = warps, stages

        print("runs kernel (query rows, key block, stages):")
        runs = [(rows, block_n, stages) for rows in (64, 128) for block_n in (64, 128) for stages in (2, 3)]
        figures["best runs"] = sweep(calls, [prefill, mixed], set_runs, runs, args.repeats)
        print("decode kernel (warps, stages):")
        decode = [(4, 2), (8, 2), (4, 3), (2, 2)]
        figures["best decode"] = sweep(calls, ["decode 64", "decode 256", mixed], set_decode, decode, args.repeats)
        print(f"fastest: runs {figures['best runs']}, decode {figures['best decode']}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
