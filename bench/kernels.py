"""Multi-LoRA kernel benchmark on one CUDA GPU: our Triton op against the base GEMM and two baselines.

For each projection (4096x4096 and 4096x14336, bf16), token count T, number of distinct adapters
and rank, it times in one run:

- ``base``: the projection's GEMM ``x @ W^T``;
- ``ours``: ``kernels.lora_apply`` (shrink + expand) with the step's metadata already prepared
  (``prepare`` runs once per step for all 224 LoRA layers of an 8B model; timed on its own);
- ``gather+bmm``: every token's A and B gathered, two batched matmuls;
- ``loop``: a PEFT-style loop over adapters (index the adapter's tokens, two matmuls, index-add);

eagerly (CUDA events around each call, so host launch overhead counts) and, for decode sizes
(T <= 256), as replays of a captured CUDA graph (device time only). Bandwidth is reported on the
bytes the LoRA op must move at least: the distinct adapters' A and B, plus reading x and
reading and writing y.

With ``--sweep``, it also times shrink and expand alone for the three target cases under several
launch configurations (the table in kernels/triton_lora.py is chosen from such a sweep).
With ``--cpu`` it instead times the torch reference's two strategies on CPU (fp32), which sets
``kernels.reference.DENSE_MAX_MACS``.

    python bench/kernels.py [--out DIR] [--quick] [--sweep]
    python bench/kernels.py --cpu
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file's folder heads sys.path and its name would shadow the kernels package.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import LoRAMeta, lora_apply  # noqa: E402
from kernels import reference, triton_lora  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336)]
TOKENS = [1, 16, 64, 256, 4096]
ADAPTERS = [1, 8, 32, 128]
RANKS = [16, 64]
NUM_SLOTS = 128  # the engine's max_loras: slot tensors are this big whatever the mix
DTYPE = torch.bfloat16
GRAPH_MAX_TOKENS = 256


def median_ms(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in ms; do_bench flushes the L2 cache before every call."""
    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def graph_ms(fn: Callable[[], object]) -> float:
    """Median time of one replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay)


def copy_bandwidth() -> float:
    """Achieved device-to-device copy bandwidth in GB/s (bytes read + written), the practical ceiling."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def bench_case(hidden: int, width: int, tokens: int, adapters: int, rank: int, weights: dict) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(tokens * 131 + adapters)
    x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen)
    y = torch.randn(tokens, width, device="cuda", dtype=DTYPE, generator=gen)
    W, A, B, scaling = weights["W"], weights["A"], weights["B"], weights["scaling"]
    # Distinct adapters spread over the slot pool; tokens dealt round-robin so each has ~T/N tokens.
    used = torch.randperm(NUM_SLOTS, device="cuda", generator=gen)[:adapters]
    slots = used[torch.arange(tokens, device="cuda") % adapters]
    slots = slots[torch.randperm(tokens, device="cuda", generator=gen)]
    meta = LoRAMeta(tokens, NUM_SLOTS, "cuda").prepare(slots)

    slots_long = slots.long()
    groups = [(s, (slots_long == s).nonzero().squeeze(1)) for s in used.tolist()]

    def base() -> None:
        torch.nn.functional.linear(x, W)

    def ours() -> None:
        lora_apply(y, x, A, B, scaling, meta)

    def gather_bmm() -> None:
        h = torch.bmm(A[slots_long], x.unsqueeze(-1))
        delta = torch.bmm(B[slots_long], h).squeeze(-1)
        y.add_(delta * scaling[slots_long].unsqueeze(-1).to(DTYPE))

    def loop() -> None:
        for s, idx in groups:
            out = (x[idx] @ A[s].T) @ B[s].T
            y.index_add_(0, idx, out * scaling[s].to(DTYPE))

    # Correctness at this size: ours against the gather+bmm baseline (both from the same y).
    y0 = y.clone()
    ours()
    y_ours = y.clone()
    y.copy_(y0)
    gather_bmm()
    delta_ref = (y.float() - y0.float()).norm()
    rel_err = ((y_ours.float() - y.float()).norm() / delta_ref.clamp(min=1e-30)).item()
    y.copy_(y0)

    row = dict(hidden=hidden, width=width, tokens=tokens, adapters=adapters, rank=rank, rel_err=rel_err)
    row["base_ms"] = median_ms(base)
    row["ours_ms"] = median_ms(ours)
    row["prepare_ms"] = median_ms(lambda: meta.prepare(slots))
    row["gather_bmm_ms"] = median_ms(gather_bmm)
    row["loop_ms"] = median_ms(loop)
    if tokens <= GRAPH_MAX_TOKENS:
        row["graph_base_ms"] = graph_ms(base)
        row["graph_ours_ms"] = graph_ms(ours)
        row["graph_gather_bmm_ms"] = graph_ms(gather_bmm)
        row["graph_prepare_ms"] = graph_ms(lambda: meta.prepare(slots))
    adapter_bytes = adapters * rank * (hidden + width) * 2
    io_bytes = tokens * hidden * 2 + 2 * tokens * width * 2
    ours_ms = row.get("graph_ours_ms", row["ours_ms"])
    row["adapter_bytes"] = adapter_bytes
    row["adapter_gbps"] = adapter_bytes / ours_ms / 1e6
    row["total_gbps"] = (adapter_bytes + io_bytes) / ours_ms / 1e6
    return row


def fmt_row(r: dict) -> str:
    g = lambda key: f"{r[key] * 1000:.1f}" if key in r else "–"  # noqa: E731  (µs)
    ours = r.get("graph_ours_ms", r["ours_ms"])
    base = r.get("graph_base_ms", r["base_ms"])
    return (
        f"| {r['hidden']}x{r['width']} | {r['tokens']} | {r['adapters']} | {r['rank']} "
        f"| {g('base_ms')} | {g('ours_ms')} | {g('gather_bmm_ms')} | {g('loop_ms')} "
        f"| {g('graph_base_ms')} | {g('graph_ours_ms')} | {g('graph_gather_bmm_ms')} "
        f"| {100 * ours / base:.0f} % | {r['loop_ms'] / r['ours_ms']:.0f}x | {r['gather_bmm_ms'] / r['ours_ms']:.1f}x "
        f"| {r['adapter_gbps']:.0f} | {r['total_gbps']:.0f} | {r['rel_err']:.1e} |"
    )


HEADER = (
    "| projection | T | adapters | rank | base µs | ours µs | gather+bmm µs | loop µs "
    "| graph: base µs | graph: ours µs | graph: gather+bmm µs "
    "| ours / base | loop / ours | gather / ours | adapter GB/s | total GB/s | rel. err |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="directory for kernels_bench.json and .md")
    parser.add_argument("--quick", action="store_true", help="only the target rows' sizes")
    parser.add_argument("--sweep", action="store_true", help="also time launch configurations of the target cases")
    parser.add_argument("--cpu", action="store_true", help="time the torch reference's strategies on CPU instead")
    args = parser.parse_args()
    if args.cpu:
        cpu_strategies()
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA device (or --cpu)")

    started = time.time()
    props = torch.cuda.get_device_properties(0)
    env = dict(
        device=props.name, sms=props.multi_processor_count, torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
    )  # fmt: skip
    env["copy_gbps"] = copy_bandwidth()
    print(f"# {env}", flush=True)
    rows = []
    for hidden, width in SHAPES:
        for rank in RANKS:
            gen = torch.Generator(device="cuda").manual_seed(rank)
            weights = dict(
                W=torch.randn(width, hidden, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(hidden),
                A=torch.randn(NUM_SLOTS, rank, hidden, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(hidden),
                B=torch.randn(NUM_SLOTS, width, rank, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(rank),
                scaling=torch.full((NUM_SLOTS,), 2.0, device="cuda"),
            )
            for tokens in TOKENS:
                for adapters in ADAPTERS:
                    if adapters > tokens:
                        continue
                    if args.quick and (tokens, adapters) not in {(64, 32), (4096, 8), (256, 128)}:
                        continue
                    row = bench_case(hidden, width, tokens, adapters, rank, weights)
                    rows.append(row)
                    print(fmt_row(row), flush=True)
                    save(args.out, env, rows, [])
            del weights
            torch.cuda.empty_cache()
    table = HEADER + "\n" + "\n".join(fmt_row(r) for r in rows)
    print(table, flush=True)
    sweeps = sweep() if args.sweep else []
    env["seconds"] = time.time() - started
    save(args.out, env, rows, sweeps)


def save(out: Path | None, env: dict, rows: list[dict], sweeps: list[dict]) -> None:
    """Write what has been measured so far (a run cut short still leaves its rows)."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_bench.json").write_text(json.dumps(dict(env=env, rows=rows, sweeps=sweeps), indent=1))
    table = HEADER + "\n" + "\n".join(fmt_row(r) for r in rows)
    (out / "kernels_bench.md").write_text(f"{env}\n\n{table}\n")


# (hidden, width, tokens, adapters, rank) of the targets' rows in shared/targets.md.
SWEEP_CASES = [
    (4096, 4096, 64, 32, 16),
    (4096, 4096, 4096, 8, 16),
    (4096, 4096, 256, 128, 16),
    (4096, 14336, 256, 128, 16),
]


def cpu_strategies() -> None:
    """Median µs of the reference's all-slots GEMM strategy and its per-slot loop, fp32 on CPU."""

    def cpu_ms(fn: Callable[[], object], repeat: int = 30) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2] * 1000

    print(f"# CPU, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| T | slots | rank | K | N | all-slots GEMMs µs | per-slot loop µs | base GEMM µs | prepare µs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for tokens, slots, rank, hidden, width in [
        (32, 8, 16, 64, 64), (32, 8, 16, 256, 256), (32, 16, 16, 256, 768), (128, 8, 16, 256, 256),
        (256, 8, 16, 1024, 1024), (512, 8, 64, 256, 256), (2048, 8, 16, 256, 256),
    ]:  # fmt: skip
        gen = torch.Generator().manual_seed(tokens)
        token_slots = torch.randint(-1, slots, (tokens,), generator=gen)
        x, y = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, width, generator=gen)
        A, B = torch.randn(slots, rank, hidden, generator=gen), torch.randn(slots, width, rank, generator=gen)
        W, scaling = torch.randn(width, hidden, generator=gen), torch.rand(slots, generator=gen)
        meta = LoRAMeta(tokens, slots).prepare(token_slots)
        timings = []
        for threshold in (1 << 62, 0):
            reference.DENSE_MAX_MACS = threshold
            timings.append(cpu_ms(lambda: lora_apply(y, x, A, B, scaling, meta)))
        base = cpu_ms(lambda: torch.nn.functional.linear(x, W))
        prep = cpu_ms(lambda: meta.prepare(token_slots))
        print(f"| {tokens} | {slots} | {rank} | {hidden} | {width} | {timings[0] * 1000:.0f} | {timings[1] * 1000:.0f} "
              f"| {base * 1000:.0f} | {prep * 1000:.0f} |")  # fmt: skip


def sweep() -> list[dict]:
    """Shrink and expand timed alone under alternative launch configurations, per target case."""
    results = []
    for hidden, width, tokens, adapters, rank in SWEEP_CASES:
        gen = torch.Generator(device="cuda").manual_seed(7)
        x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen)
        y = torch.randn(tokens, width, device="cuda", dtype=DTYPE, generator=gen)
        A = torch.randn(NUM_SLOTS, rank, hidden, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(hidden)
        B = torch.randn(NUM_SLOTS, width, rank, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(rank)
        scaling = torch.full((NUM_SLOTS,), 2.0, device="cuda")
        used = torch.randperm(NUM_SLOTS, device="cuda", generator=gen)[:adapters]
        slots = used[torch.arange(tokens, device="cuda") % adapters]
        meta = LoRAMeta(tokens, NUM_SLOTS, "cuda").prepare(slots)
        timer = graph_ms if tokens <= GRAPH_MAX_TOKENS else median_ms
        base_sc = triton_lora.shrink_config(meta, hidden, rank, 1)
        base_ec = triton_lora.expand_config(meta, rank)
        h_ref = triton_lora.shrink(x, [A], meta, None, base_sc)
        prefill = tokens > GRAPH_MAX_TOKENS
        shrink_variants = {base_sc}
        for block_k in (64, 128) if prefill else (128, 256, 512):
            for split_k in (1, 2, 4) if prefill else (base_sc.split_k // 2, base_sc.split_k, base_sc.split_k * 2):
                for num_warps in (4, 8):
                    if 1 <= split_k and split_k * block_k <= hidden:
                        shrink_variants.add(
                            triton_lora.ShrinkConfig(base_sc.block_m, base_sc.block_r, block_k, split_k, num_warps, 3)
                        )
        expand_variants = {base_ec}
        for block_m in (16, 64) if prefill else (16,):
            for block_n in (64, 128, 256):
                for num_warps, num_stages in ((4, 2), (8, 2), (4, 3)):
                    cfg = triton_lora.ExpandConfig(block_m, block_n, base_ec.block_r, num_warps, num_stages)
                    expand_variants.add(cfg)
        case = dict(hidden=hidden, width=width, tokens=tokens, adapters=adapters, rank=rank)
        for cfg in sorted(shrink_variants, key=str):
            h = triton_lora.shrink(x, [A], meta, None, cfg)
            err = ((h - h_ref).norm() / h_ref.norm()).item()
            ms = timer(lambda cfg=cfg: triton_lora.shrink(x, [A], meta, None, cfg))
            results.append(dict(case, kernel="shrink", config=dataclasses.asdict(cfg), ms=ms, rel_err=err,
                                default=cfg == base_sc))  # fmt: skip
        for cfg in sorted(expand_variants, key=str):
            ms = timer(lambda cfg=cfg: triton_lora.expand(y, h_ref, [B], scaling, meta, (0,), None, cfg))
            results.append(dict(case, kernel="expand", config=dataclasses.asdict(cfg), ms=ms, default=cfg == base_ec))
        for kernel in ("shrink", "expand"):
            mine = [r for r in results if r["kernel"] == kernel and all(r[k] == v for k, v in case.items())]
            best = min(mine, key=lambda r: r["ms"])
            default = next(r for r in mine if r["default"])
            print(f"# sweep {case} {kernel}: default {default['ms'] * 1000:.1f} µs {default['config']}; "
                  f"best {best['ms'] * 1000:.1f} µs {best['config']} ({len(mine)} configs)", flush=True)  # fmt: skip
    return results


if __name__ == "__main__":
    main()
