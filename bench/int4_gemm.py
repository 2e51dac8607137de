"""The AWQ INT4 dequant-GEMM (kernels.int4.matmul_triton) against the bf16 GEMM it replaces, on one
CUDA GPU, at the Llama-3-8B projections' shapes (group 128) and decode-to-prefill token counts.

Per shape and token count: the bf16 ``x @ W^T`` (cuBLAS), the INT4 kernel, their ratio, and the
INT4 kernel's achieved bandwidth over the bytes it must read at least (packed weight, scales,
zeros, x) and write (y). Times are ``triton.testing.do_bench`` medians (ms); nothing is asserted.

    python bench/int4_gemm.py [--group-size 128] [--tokens 1 16 64 256 2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from kernels import int4  # noqa: E402

# (name, in, out) of the 8B shape's fused projections.
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/int4_gemm.py times CUDA kernels: no CUDA device")
    print(f"{torch.cuda.get_device_name()}; AWQ group {args.group_size}; bf16 activations")
    print("| projection | tokens | bf16 ms | INT4 ms | INT4 / bf16 | INT4 GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    for name, k, n in SHAPES:
        weight = torch.randn(n, k, generator=generator) * 0.02
        qweight, qzeros, scales = (t.cuda() for t in int4.quantize(weight, args.group_size))
        w_bf16 = weight.to("cuda", torch.bfloat16)
        packed_bytes = sum(t.numel() * t.element_size() for t in (qweight, qzeros, scales))
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
            bf16_ms = do_bench(lambda: F.linear(x, w_bf16))
            int4_ms = do_bench(lambda: int4.matmul_triton(x, qweight, qzeros, scales, args.group_size))
            moved = packed_bytes + 2 * tokens * (k + n)
            print(f"| {name} {k}x{n} | {tokens} | {bf16_ms:.4f} | {int4_ms:.4f} | {int4_ms / bf16_ms:.2f} "
                  f"| {moved / int4_ms / 1e6:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
