"""The benches' timing: bench/trainer.py's stamps and --profile window, and the device time per step (bench/profiles.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.profiles import device_ms_per_step
from bench.trainer import ProfilingTimer, StepTimer


def _step(timer: ProfilingTimer, step: int, op: torch.Tensor) -> None:
    # What a training step would run, then the hook the trainer calls after it.
    (op @ op).sum()
    timer.on_step(step, 10, 0.0, step * 64)


def test_the_table_covers_the_steps_after_the_warmup(tmp_path: Path) -> None:
    out = tmp_path / "profile.txt"
    timer = ProfilingTimer(out, start=2, steps=3)
    a = torch.ones(8, 8)
    for step in (1, 2):
        # aten::sigmoid marks the warm-up steps: the table must not hold it.
        torch.sigmoid(a)
        _step(timer, step, a)
    assert not out.exists()
    for step in (3, 4):
        # aten::tanh marks the profiled steps: only they run it.
        torch.tanh(a)
        _step(timer, step, a)
    assert not out.exists()
    torch.tanh(a)
    _step(timer, 5, a)
    text = out.read_text()
    assert text.startswith("profiled step:")
    assert "aten::tanh" in text and "aten::mm" in text
    assert "aten::sigmoid" not in text
    # Steps after the window are not profiled, and the file is written once.
    out.unlink()
    _step(timer, 6, a)
    assert not out.exists()
    assert len(timer.stamps) == 6


class _Row:
    def __init__(self, device_type: torch.autograd.DeviceType, us: float, annotation: bool = False) -> None:
        self.device_type, self.self_device_time_total, self.is_user_annotation = device_type, us, annotation


def test_device_time_counts_kernels_not_annotations_or_ops() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    # Two kernels; an annotation's GPU span over them and its gaps; an op row repeating its kernel.
    rows = [_Row(cuda, 3000.0), _Row(cuda, 1000.0), _Row(cuda, 9000.0, annotation=True), _Row(cpu, 3000.0)]
    assert device_ms_per_step(rows, steps=2) == 2.0


def test_the_stamps_wait_for_the_gpu_only_at_the_steps_a_figure_divides_by(monkeypatch: pytest.MonkeyPatch) -> None:
    # The trainer's host runs ahead of the GPU: a stamp the figure uses must wait for the stream,
    # and no other may (waiting every step would stall the loop where training does not).
    waited: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: waited.append(len(timer.stamps) + 1))
    timer = StepTimer(sync_steps=(3, 8))
    for step in range(1, 9):
        timer.on_step(step, 8, step / 8, step * 64)
    assert waited == [3, 8]
    assert [tokens for _, tokens in timer.stamps] == [step * 64 for step in range(1, 9)]
