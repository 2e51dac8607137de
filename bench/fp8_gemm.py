"""The FP8 projection GEMM against bf16's at the row counts a serving step multiplies (issue 38,
item 6), on one Hopper GPU, at the Llama-3-8B shape's fused projections.

The serve curve's steps are mostly *mixed* (a few hundred decode rows beside one prompt's chunk), so
FP8 pays only if its GEMM is faster than bf16's at 64-512 rows, not only at the decode step's 64
(where halving the weight's bytes wins) or a 2,048-token prefill. Per shape and row count this
prints, as ``triton.testing.do_bench`` medians and TFLOP/s:

- ``bf16``: ``F.linear`` (cuBLAS), what the unquantized engine runs;
- ``fp8 rowwise``: ``torch._scaled_mm`` with a scale per activation row and per weight column, fp32
  accumulation in full (``use_fast_accum=False``), what ``serving.engine.layers.fp8_linear`` runs;
- ``fp8 rowwise fast``: the same with ``use_fast_accum=True`` (Hopper's FP8 tensor-core accumulator
  is narrower than fp32; fast accumulation skips the periodic promotion to fp32 registers);
- ``fp8 tensorwise fast``: one scale for each operand, the form cuBLAS tunes most (the bound on what
  a change of scaling could give; the engine keeps rowwise scales for their accuracy);

and, for each FP8 form, its largest difference from the rowwise product (the accuracy fast
accumulation costs, relative to the output's largest magnitude). The row totals weigh the four
projections as a layer runs them. Nothing is asserted; the figures go into docs/benchmarks.md.

    python bench/fp8_gemm.py [--rows 64 128 256 319 512 1024 2048] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from bench.card import card  # noqa: E402
from kernels.fp8 import quantize_rows_triton  # noqa: E402

# (name, in, out) of the 8B shape's fused projections.
SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
FORMS = ("bf16", "fp8 rowwise", "fp8 rowwise fast", "fp8 tensorwise fast")


def time_shape(rows: int, k: int, n: int) -> dict[str, Any]:
    """Each form's median ms at ``rows x k @ k x n``, and each FP8 form's error against the rowwise product."""
    device = torch.device("cuda")
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    x_q, x_scale = quantize_rows_triton(x)
    w_q, w_scale = quantize_rows_triton(w)
    w_scale = w_scale.view(1, n).contiguous()
    x_amax = x.abs().amax().float() / 448.0
    w_amax = w.abs().amax().float() / 448.0
    x_t = (x.float() / x_amax).to(torch.float8_e4m3fn)
    w_t = (w.float() / w_amax).to(torch.float8_e4m3fn)
    calls = {
        "bf16": lambda: F.linear(x, w),
        "fp8 rowwise": lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale,
                                                out_dtype=torch.bfloat16),
        "fp8 rowwise fast": lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale,
                                                     out_dtype=torch.bfloat16, use_fast_accum=True),
        "fp8 tensorwise fast": lambda: torch._scaled_mm(x_t, w_t.t(), scale_a=x_amax, scale_b=w_amax,
                                                        out_dtype=torch.bfloat16, use_fast_accum=True),
    }
    reference = calls["fp8 rowwise"]().float()
    magnitude = reference.abs().max().item()
    result: dict[str, Any] = {"ms": {}, "error": {}}
    for form, call in calls.items():
        result["ms"][form] = do_bench(call, warmup=25, rep=100)
        if form != "bf16":
            result["error"][form] = (call().float() - reference).abs().max().item() / magnitude
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 319, 512, 1024, 2048])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("bench/fp8_gemm.py needs a Hopper GPU (torch._scaled_mm's rowwise FP8)")
    results: dict[str, Any] = {"card": card(), "rows": {}}
    for rows in args.rows:
        per_shape = {name: time_shape(rows, k, n) for name, k, n in SHAPES}
        flops = sum(2 * rows * k * n for _, k, n in SHAPES)
        totals = {form: sum(shape["ms"][form] for shape in per_shape.values()) for form in FORMS}
        results["rows"][rows] = {"shapes": per_shape, "layer_ms": totals}
        print(f"rows {rows}: a layer's four projections")
        for form in FORMS:
            ms = totals[form]
            errors = [shape["error"].get(form, 0.0) for shape in per_shape.values()]
            print(f"  {form:20s} {ms * 1e3:8.1f} us  {flops / ms / 1e9:6.0f} TFLOP/s  "
                  f"{totals['bf16'] / ms:5.2f} x bf16  max rel. diff {max(errors):.1e}  "
                  + "  ".join(f"{name} {shape['ms'][form] * 1e3:.1f}" for name, shape in per_shape.items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
