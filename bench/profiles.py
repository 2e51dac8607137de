"""The torch.profiler table the benches write: where a step's device time goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def device_ms_per_step(averages: Any, steps: int) -> float:
    """The kernels' device time per step. Only kernel rows count: an op row (aten::mm) repeats the
    time of the kernels it launched, and a user annotation's GPU row (Optimizer.step#AdamW.step)
    spans its kernels and the idle gaps between them."""
    kernels = [e for e in averages
               if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    return sum(e.self_device_time_total for e in kernels) / steps / 1e3


def write_profile(prof: Any, out: Path, steps: int, wall_ms: float, rows: int = 20) -> float:
    """Write `prof`'s tables (by device time, then by CPU time) to `out`, headed by the wall time and
    the kernels' device time per step; returns that device time (ms)."""
    averages = prof.key_averages()
    device_ms = device_ms_per_step(averages, steps)
    out.write_text(
        f"profiled step: {wall_ms:.2f} ms wall (with profiler overhead), device busy {device_ms:.2f} ms per step\n\n"
        + averages.table(sort_by="self_device_time_total", row_limit=rows) + "\n\n"
        + averages.table(sort_by="self_cpu_time_total", row_limit=20)
    )  # fmt: skip
    return device_ms
