"""The AWQ INT4 dequant-GEMM (kernels.int4.matmul_triton) against the bf16 GEMM it replaces, on one
CUDA GPU, at the Llama-3-8B projections' shapes (group 128) and decode-to-prefill token counts.

Per shape and token count: the bf16 ``x @ W^T`` (cuBLAS), the INT4 kernel at the launch
configuration ``kernels.int4.gemm_config`` picks (printed: tile M x N x K, split-K as launched,
warps, stages, ``interleave`` where each packed word is loaded once and widened in registers),
their ratio, the INT4 kernel's achieved bandwidth over the bytes it must read at least (packed
weight, scales, zeros, x) and write (y), and the other path: the weight dequantized whole by
``kernels.int4.dequantize_triton`` and multiplied by cuBLAS (``dequant+cuBLAS``), with the path
``kernels.int4.matmul`` takes at that row count (``DEQUANT_MIN_ROWS``: the crossover to set it from). Times are ``triton.testing.do_bench`` medians (ms);
nothing is asserted.

``--configs`` also times a short list of candidate configurations per row (:func:`candidates`: the
decode tiles with split-K automatic, off, halved and doubled, the prefill tiles of the Triton matmul
tutorial's family, and both unpackings), one line each with its time and its error against the torch
reference (a candidate that fails to compile or run prints its error and the sweep goes on), then
the fastest per row: the figures to set ``gemm_config``'s table from.

    python bench/int4_gemm.py [--group-size 128] [--tokens 1 16 64 256 2048] [--configs]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import int4  # noqa: E402
from kernels.int4 import GemmConfig  # noqa: E402

# (name, in, out) of the 8B shape's fused projections.
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]


def candidates(tokens: int, n: int, k: int, group_size: int, sms: int) -> list[GemmConfig]:
    """The configurations ``--configs`` times at ``tokens`` rows of an ``[k, n]`` weight: the
    default first, then alternatives (block_k lowered where the group needs it; launches that
    come out the same dropped)."""
    chosen = int4.gemm_config(tokens, n, k, group_size, torch.device("cuda"))

    def config(block_m: int, block_n: int, block_k: int, warps: int, stages: int, split: int | None = None,
               interleave: bool = False) -> GemmConfig:  # fmt: skip
        if split is None:
            split = int4.auto_split_k(tokens, n, k, group_size, block_m, block_n, sms)
        return GemmConfig(block_m, block_n, int4.block_k_for(group_size, block_k), split, warps, stages, interleave)

    if tokens <= 64:
        bm = chosen.block_m
        listed = [
            # The default tile with split-K off, halved, doubled, and gathered (the first version's unpacking).
            dataclasses.replace(chosen, split_k=1),
            dataclasses.replace(chosen, split_k=max(1, chosen.split_k // 2)),
            dataclasses.replace(chosen, split_k=2 * chosen.split_k),
            dataclasses.replace(chosen, interleave=False),
            config(bm, 64, 128, 4, 3, interleave=True),
            config(bm, 64, 128, 4, 4, interleave=True),
            config(bm, 64, 64, 4, 4, interleave=True),
            config(bm, 128, 128, 4, 3, interleave=True),
            config(bm, 128, 64, 4, 4, interleave=True),
            config(bm, 128, 128, 8, 3, interleave=True),
            config(bm, 32, 128, 4, 3, interleave=True),
        ]
    else:
        listed = [
            config(64, 64, 64, 4, 3),  # the first version's tile and unpacking, pipelined
            config(128, 128, 64, 8, 3),  # gathered
            config(64, 128, 64, 4, 4, interleave=True),
            config(64, 128, 64, 4, 4, split=1, interleave=True),  # no split-K where the automatic one would split
            config(128, 128, 64, 8, 3, interleave=True),
            config(128, 128, 64, 8, 4, interleave=True),
            config(128, 128, 128, 8, 3, interleave=True),
            config(128, 256, 64, 8, 3, interleave=True),
            config(256, 128, 64, 8, 3, interleave=True),
        ]
    unique = {describe(chosen, k, group_size): chosen}
    for c in listed:  # the same launch twice (a split that split_plan makes equal to another) runs once
        unique.setdefault(describe(c, k, group_size), c)
    return list(unique.values())


def describe(config: GemmConfig, k: int, group_size: int) -> str:
    """The config as launched: its split-K is the one split_plan makes of the requested one."""
    splits = int4.split_plan(k, group_size, config.split_k)[1]
    return str(dataclasses.replace(config, split_k=splits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    parser.add_argument("--configs", action="store_true", help="also time the candidate configurations per row")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/int4_gemm.py times CUDA kernels: no CUDA device")
    device = torch.device("cuda")
    sms = int4.sm_count(device)
    print(f"{torch.cuda.get_device_name()} ({sms} SMs); AWQ group {args.group_size}; bf16 activations")
    print("| projection | tokens | bf16 ms | INT4 ms | INT4 / bf16 | INT4 GB/s | config | dequant+cuBLAS ms "
          "| dequant+cuBLAS / bf16 | matmul takes |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|---|")
    sweeps: list[str] = []
    generator = torch.Generator().manual_seed(0)
    for name, k, n in SHAPES:
        weight = torch.randn(n, k, generator=generator) * 0.02
        qweight, qzeros, scales = (t.cuda() for t in int4.quantize(weight, args.group_size))
        w_bf16 = weight.to("cuda", torch.bfloat16)
        packed_bytes = sum(t.numel() * t.element_size() for t in (qweight, qzeros, scales))
        w_ref = None  # the reference weight, for the candidates' errors
        if args.configs:
            w_ref = int4.dequantize(qweight, qzeros, scales, args.group_size, torch.bfloat16).float()
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            chosen = int4.gemm_config(tokens, n, k, args.group_size, device)
            bf16_ms = do_bench(lambda: F.linear(x, w_bf16))
            int4_ms = do_bench(lambda: int4.matmul_triton(x, qweight, qzeros, scales, args.group_size, chosen))
            dequant_ms = do_bench(lambda: x @ int4.dequantize_triton(qweight, qzeros, scales, args.group_size, x.dtype))
            takes = "dequant+cuBLAS" if tokens >= int4.DEQUANT_MIN_ROWS else "fused"
            moved = packed_bytes + 2 * tokens * (k + n)
            print(f"| {name} {k}x{n} | {tokens} | {bf16_ms:.4f} | {int4_ms:.4f} | {int4_ms / bf16_ms:.2f} "
                  f"| {moved / int4_ms / 1e6:.0f} | {describe(chosen, k, args.group_size)} | {dequant_ms:.4f} "
                  f"| {dequant_ms / bf16_ms:.2f} | {takes} |", flush=True)  # fmt: skip
            if w_ref is not None:
                sweeps.extend(sweep(name, k, n, tokens, x, (qweight, qzeros, scales), args.group_size, sms, w_ref,
                                    bf16_ms, moved))  # fmt: skip
    if sweeps:
        print("\nFastest candidate per row (--configs):\n")
        print("| projection | tokens | bf16 ms | best INT4 ms | INT4 / bf16 | INT4 GB/s | config |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for line in sweeps:
            print(line)


def sweep(name: str, k: int, n: int, tokens: int, x: torch.Tensor, packed: tuple[torch.Tensor, ...], group_size: int,
          sms: int, w_ref: torch.Tensor, bf16_ms: float, moved: int) -> list[str]:  # fmt: skip
    """Time each candidate at this row (printed as it goes); the fastest's summary line."""
    qweight, qzeros, scales = packed
    expected = x.float() @ w_ref
    best: tuple[float, GemmConfig] | None = None
    print(f"  candidates, {name} {k}x{n}, {tokens} tokens (ms; relative error against the torch reference):")
    for config in candidates(tokens, n, k, group_size, sms):
        try:
            y = int4.matmul_triton(x, qweight, qzeros, scales, group_size, config).float()
            error = float((y - expected).norm() / expected.norm())
            ms = do_bench(lambda: int4.matmul_triton(x, qweight, qzeros, scales, group_size, config))
        except Exception as exc:  # a candidate that does not compile or run: say so, keep sweeping
            print(f"    {describe(config, k, group_size)}: failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        print(f"    {describe(config, k, group_size)}: {ms:.4f} (error {error:.1e})", flush=True)
        if error < 1e-2 and (best is None or ms < best[0]):
            best = (ms, config)
    if best is None:
        return [f"| {name} {k}x{n} | {tokens} | {bf16_ms:.4f} | none ran correctly | | | |"]
    ms, config = best
    return [f"| {name} {k}x{n} | {tokens} | {bf16_ms:.4f} | {ms:.4f} | {ms / bf16_ms:.2f} | {moved / ms / 1e6:.0f} "
            f"| {describe(config, k, group_size)} |"]  # fmt: skip


if __name__ == "__main__":
    main()
