"""The LoRA kernels on a serving step's token layout, under the decode and the prefill tables.

`kernels.triton_lora` picks its launch tables by the step's token count (decode tables up to
`DECODE_MAX_TOKENS`). A serving step mixes a decode batch spread over many adapters with a prompt
of one adapter, so its count says little about its groups. This times one layer's four LoRA
projections of the Llama-3-8B shape (rank 16, 32 slots, bf16; replayed from a CUDA graph, so launch
overhead is not counted) for a few such layouts under each table, CUDA only:

    python3 bench/lora_mixed.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from kernels import LoRAMeta  # noqa: E402
from kernels.triton_lora import (  # noqa: E402
    DECODE_EXPAND,
    DECODE_SHRINK_PROGRAMS,
    PREFILL_EXPAND,
    PREFILL_SHRINK,
    _decode_shrink,
    expand,
    shrink,
)

SLOTS, RANK, HIDDEN, INTER = 32, 16, 4096, 14336
# (input width, output slice widths) of qkv, o, gate_up, down.
PROJECTIONS = [(HIDDEN, [HIDDEN, 1024, 1024]), (HIDDEN, [HIDDEN]), (HIDDEN, [INTER, INTER]), (INTER, [HIDDEN])]
LAYOUTS = {
    "decode 64 over 32 adapters": [i % SLOTS for i in range(64)],
    "mixed: 63 decoding + a 256-token prompt": [i % SLOTS for i in range(63)] + [SLOTS - 1] * 256,
    "mixed: 150 decoding + a 256-token prompt": [i % SLOTS for i in range(150)] + [5] * 256,
    "prefill: two 256-token prompts": [3] * 256 + [9] * 256,
}


def layer_us(token_slots: list[int], table: str, reps: int = 20) -> float:
    device = torch.device("cuda")
    meta = LoRAMeta(2048, SLOTS, device).prepare(torch.tensor(token_slots, dtype=torch.int32, device=device))
    ranks = torch.full((SLOTS,), RANK, dtype=torch.int32, device=device)
    scaling = torch.full((SLOTS,), 2.0, device=device)
    tokens = len(token_slots)
    work = []
    for k, widths in PROJECTIONS:
        x = torch.randn(tokens, k, dtype=torch.bfloat16, device=device)
        y = torch.zeros(tokens, sum(widths), dtype=torch.bfloat16, device=device)
        As = [torch.randn(SLOTS, RANK, k, dtype=torch.bfloat16, device=device) * 0.01 for _ in widths]
        Bs = [torch.randn(SLOTS, n, RANK, dtype=torch.bfloat16, device=device) * 0.01 for n in widths]
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        if table == "decode":
            sc = _decode_shrink(meta.grid_tiles(16) * len(widths), k, RANK, DECODE_SHRINK_PROGRAMS)
            ec = DECODE_EXPAND[16]
        else:
            sc, ec = PREFILL_SHRINK[16], PREFILL_EXPAND[16]
        work.append((x, y, As, Bs, offsets, sc, ec))

    def run() -> None:
        for x, y, As, Bs, offsets, sc, ec in work:
            expand(y, shrink(x, As, meta, ranks, sc), Bs, scaling, meta, offsets, ranks, ec)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            run()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def main() -> int:
    print(f"{'layout':45s} {'tokens':>6s} {'decode tables':>14s} {'prefill tables':>15s}  (us per layer, 4 projections)")
    for name, slots in LAYOUTS.items():
        print(f"{name:45s} {len(slots):6d} {layer_us(slots, 'decode'):14.1f} {layer_us(slots, 'prefill'):15.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
