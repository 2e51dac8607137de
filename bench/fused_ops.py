"""SiLU·mul with its output quantized to FP8 (``kernels.fused_ops.silu_mul_fp8``, what an FP8 engine
runs before each down projection) against the bf16 ``silu_mul`` alone, on one CUDA GPU, at the
Llama-3-8B MLP's width: ``gate|up [M, 2 x 14336]`` bf16 in, ``[M, 14336]`` bf16 plus its e4m3 rows
and a scale a row out. For each width and M it prints median µs, as CUDA-graph replays (device time,
what the engine's captured steps pay) and eagerly (host launch included), of

- ``silu_mul``: the bf16 kernel alone;
- ``fp8``: ``silu_mul_fp8`` (one program a row, the row whole);
- ``unfused``: ``silu_mul`` then ``kernels.fp8.quantize_rows_triton``, what the fusion replaces.

Each FP8 variant is first checked bit-equal to the unfused pair. ``triton.testing.do_bench`` flushes
the L2 cache before every call, so the input comes from memory each time.

    python bench/fused_ops.py [--rows 64 319 1024] [--widths 14336] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file's folder heads sys.path and its name would shadow the kernels package.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from bench.card import card  # noqa: E402
from bench.kernels import graph_ms, median_ms  # noqa: E402
from kernels import fused_ops  # noqa: E402
from kernels.fp8 import QuantizedRows, quantize_rows_triton  # noqa: E402

def unfused(gate_up: torch.Tensor) -> tuple[torch.Tensor, QuantizedRows]:
    out = fused_ops.silu_mul(gate_up)
    return out, quantize_rows_triton(out)


def time_case(rows: int, width: int) -> dict[str, dict[str, float]]:
    """``{variant: {"graph_us": ..., "eager_us": ...}}`` at ``[rows, 2 x width]``, the FP8 kernel checked first."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16, generator=gen) * 3
    expected_out, expected = unfused(gate_up)
    calls: dict[str, Callable[[], object]] = {
        "silu_mul": lambda: fused_ops.silu_mul(gate_up),
        "fp8": lambda: fused_ops.silu_mul_fp8(gate_up),
        "unfused": lambda: unfused(gate_up),
    }
    out, (q, scale) = fused_ops.silu_mul_fp8(gate_up)
    same = torch.equal(out, expected_out) and torch.equal(scale, expected.scale)
    if not same or not torch.equal(q.view(torch.uint8), expected.q.view(torch.uint8)):
        raise SystemExit(f"silu_mul_fp8 at M = {rows}, width {width} is not bit-equal to the unfused pair")
    return {name: {"graph_us": graph_ms(call) * 1e3, "eager_us": median_ms(call) * 1e3} for name, call in calls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 319, 1024])
    parser.add_argument("--widths", type=int, nargs="+", default=[14336], help="N of gate|up [M, 2N]")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/fused_ops.py needs a CUDA device")
    results: dict[str, object] = {"card": card()}
    cases = []
    names = ["silu_mul", "fp8", "unfused"]
    print("| width | M | " + " | ".join(f"{name} µs" for name in names) + " | fp8 / silu_mul |")
    print("| --- " * (len(names) + 3) + "|")
    for width in args.widths:
        for rows in args.rows:
            timed = time_case(rows, width)
            cases.append({"width": width, "rows": rows, "us": timed})
            for mode in ("graph", "eager"):
                cells = " | ".join(f"{timed[name][f'{mode}_us']:.1f}" for name in names)
                ratio = timed["fp8"][f"{mode}_us"] / timed["silu_mul"][f"{mode}_us"]
                print(f"| {width} | {rows} ({mode}) | {cells} | {ratio:.2f} |", flush=True)
    results["cases"] = cases
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
