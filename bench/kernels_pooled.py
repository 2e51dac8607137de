"""The decode launch configurations of the multi-LoRA kernels timed on the engine's own layout: row
pools (``A [rows, in]``, ``Bt [rows, out]``, serving.engine.layers.lora_linear), every token its own
adapter at 256 (issue 21's many-adapter decode step) and the 32- and 64-adapter rows of the
decode-step table. Each case's best variants are printed against the current table's
(kernels/triton_lora.py), as CUDA-graph replays; bench/kernels.py sweeps the slot-tensor layout.

    python3 bench/kernels_pooled.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

# Run as a script, this file's folder heads sys.path and its name would shadow the kernels package.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from bench.kernels import DTYPE, graph_ms  # noqa: E402
from kernels import LoRAMeta, triton_lora  # noqa: E402


# (hidden, width, tokens, distinct adapters) of the engine's decode step at rank 16: every token its
# own adapter at 256, the 8B shape's projection widths (q/o 4096, k/v 1024, gate/up 14336, down's
# 14336 -> 4096), and the 32- and 64-adapter rows of the decode-step table.
POOLED_CASES = [(4096, 4096, 256, 256), (4096, 1024, 256, 256), (4096, 14336, 256, 256), (14336, 4096, 256, 256),
                (4096, 4096, 64, 64), (4096, 14336, 64, 32)]


def pooled_variants() -> list[dict]:
    """Shrink grid targets x expand configurations, the current table's first."""
    E, sms, one = triton_lora.ExpandConfig, 132, triton_lora.ONE_BLOCK_EACH
    expands = [triton_lora.DECODE_EXPAND[16]] + [
        E(16, block_n, programs, prefetch, warps, 1)
        for block_n, programs, prefetch, warps in [
            (64, one, False, 4), (128, one, False, 4), (256, one, False, 4), (256, one, False, 8), (512, one, False, 8),
            (128, 32 * sms, True, 4), (256, 16 * sms, True, 4), (256, 16 * sms, True, 8), (512, 8 * sms, True, 8),
            (128, 8 * sms, True, 2), (64, one, False, 2)]
    ]  # fmt: skip
    return [dict(shrink_programs=programs, expand=expand)
            for programs in (triton_lora.DECODE_SHRINK_PROGRAMS, 4 * sms, 16 * sms, 32 * sms) for expand in expands]


def pooled_sweep() -> None:
    """Every pooled case under every variant, as graph replays; per case the table's time and the best."""
    rank = 16
    for hidden, width, tokens, adapters in POOLED_CASES:
        gen = torch.Generator(device="cuda").manual_seed(hidden + width + adapters)
        pool_rows = adapters * rank
        A = torch.randn(pool_rows, hidden, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(hidden)
        Bt = torch.randn(pool_rows, width, device="cuda", dtype=DTYPE, generator=gen) / math.sqrt(rank)
        rows = (torch.arange(adapters, device="cuda", dtype=torch.int32) * rank)
        ranks = torch.full((adapters,), rank, device="cuda", dtype=torch.int32)
        scaling = torch.full((adapters,), 2.0, device="cuda")
        x = torch.randn(tokens, hidden, device="cuda", dtype=DTYPE, generator=gen)
        y0 = torch.randn(tokens, width, device="cuda", dtype=DTYPE, generator=gen)
        slots = (torch.arange(tokens, device="cuda") % adapters)[torch.randperm(tokens, device="cuda", generator=gen)]
        meta = LoRAMeta(tokens, adapters, "cuda").prepare(slots)
        y = y0.clone()
        reference = None
        timings = []
        for variant in pooled_variants():
            sc = triton_lora.shrink_config(meta, hidden, rank, 1, variant["shrink_programs"])

            def step(sc=sc, ec=variant["expand"]) -> None:
                h = triton_lora.shrink(x, [A], meta, ranks, sc, rows=rows, max_rank=rank)
                triton_lora.expand(y, h, [Bt], scaling, meta, (0,), ranks, ec, rows=rows, max_rank=rank)

            label = f"shrink programs {variant['shrink_programs']}, {variant['expand']}"
            try:
                y.copy_(y0)
                step()
                delta = y.float() - y0.float()
                if reference is None:
                    reference = delta
                rel_err = ((delta - reference).norm() / reference.norm()).item()
                ms = graph_ms(step)
            except Exception as error:  # a variant that does not compile or run is reported, not fatal
                print(f"# pooled {hidden}x{width} T{tokens} N{adapters}: {label}: {type(error).__name__}: {error}")
                continue
            timings.append((ms, rel_err, label))
        adapter_bytes = adapters * rank * (hidden + width) * 2
        table_ms = timings[0][0]
        print(f"# pooled {hidden}x{width} T{tokens} N{adapters} r{rank}: table {table_ms * 1e3:.1f} us "
              f"({adapter_bytes / table_ms / 1e6:.0f} GB/s)", flush=True)
        for ms, rel_err, label in sorted(timings)[:5]:
            print(f"#   {ms * 1e3:7.1f} us {adapter_bytes / ms / 1e6:6.0f} GB/s err {rel_err:.1e}  {label}", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels_pooled.py needs a CUDA device")
    pooled_sweep()
