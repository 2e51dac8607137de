"""The card a bench ran on, and the memory bandwidth its floors divide by (issue 38, item 7).

A figure is only comparable with one from the same card, so every bench JSON records ``card()``:
the device's name, memory, compute capability, driver and CUDA versions (the host's processor and
memory on CPU). A decode step's floor (every weight and KV byte read once) divides the bytes by a
bandwidth, and that bandwidth must be this card's, not the H200's 4.8 TB/s that bench/engine.py
assumed on any card (on the H100 it printed a 4.03 ms floor where 3.35 TB/s gives 5.77 ms).

``copy_bandwidth`` measures it at bench start: a device-to-device copy of a large buffer timed with
CUDA events, counted as read plus write. That is what the card's memory moves in practice (on
Hopper about 80-90 % of the datasheet), so a floor from it is one a kernel can reach.
``SPEC_BANDWIDTH`` gives the datasheet figure of the cards the project is lent, by the name
``torch.cuda.get_device_name`` reports, for the floor as the issue's tables quote it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

# Datasheet memory bandwidth (bytes/s) by a substring of the device name, most specific first.
SPEC_BANDWIDTH: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),  # SXM5 80 GB
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),  # 40 GB
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
)


def spec_bandwidth(name: str) -> float | None:
    """The datasheet bandwidth of the card called ``name``, or None for a card not in the table."""
    return next((bandwidth for key, bandwidth in SPEC_BANDWIDTH if key in name), None)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes/s a copy of ``nbytes`` moves on ``device`` (read + write), best of ``repeats``."""
    if nbytes < 2 or repeats < 1:
        raise ValueError(f"copy_bandwidth needs nbytes >= 2 and repeats >= 1, got {nbytes} and {repeats}")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy pays for launch and page set-up
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - began
        best = min(best, seconds)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / best


def gemm_tflops(device: torch.device, m: int = 4096, k: int = 4096, n: int = 14336, repeats: int = 10) -> float:
    """TFLOP/s of one bf16 GEMM ``[m, k] @ [k, n]`` on ``device`` (the 8B shape's gate projection for
    a 4,096-token step), best of ``repeats``: the roof a prefill step's projections can reach on this
    card, measured like the copy bandwidth rather than taken from a datasheet (whose dense bf16
    figure, 989 TFLOP/s on the H100 SXM, no GEMM of these sizes reaches)."""
    if device.type != "cuda":
        raise ValueError(f"gemm_tflops measures a CUDA device, got {device}")
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
    torch.matmul(a, b)  # cuBLAS picks and loads its kernel
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    return 2 * m * k * n / best / 1e12


def card(index: int = 0) -> dict[str, Any]:
    """What a bench JSON records of the card it ran on (GPU ``index``), or of the host where there
    is none. Read from nvidia-smi where it is installed, so a process that runs nothing on the
    card (a load generator beside its worker) opens no CUDA context for it; from torch otherwise."""
    info: dict[str, Any] = {
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda, "host": platform.node(),
        "host_cpus": os.cpu_count(),
        "host_memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }
    gpu = _nvidia_smi(index)
    if gpu is None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(index)
        gpu = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1), "driver": None,
               "compute_capability": f"{props.major}.{props.minor}"}
    if gpu is None:
        info.update(type="cpu", name=_cpu_name())
        return info
    spec = spec_bandwidth(gpu["name"])
    info.update(type="cuda", **gpu, spec_bandwidth_tb_s=spec / 1e12 if spec is not None else None)
    return info


def _cpu_name() -> str:
    """The processor's model name from /proc/cpuinfo (Linux), else its architecture. Not
    ``platform.processor()``: that runs ``uname -p``, a process, and says only ``x86_64``."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.machine()


def _nvidia_smi(index: int) -> dict[str, Any] | None:
    """Name, memory, driver version and compute capability of GPU ``index`` from nvidia-smi (None
    where it is missing or fails)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={index}", "--query-gpu=name,memory.total,driver_version,compute_cap",
             "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    fields = [field.strip() for field in out.split(",")]
    if len(fields) != 4:
        return None
    name, memory_mib, driver, capability = fields
    return {"name": name, "memory_gib": round(float(memory_mib) / 1024, 1) if memory_mib.isdigit() else None,
            "driver": driver, "compute_capability": capability}


def bandwidth_figures(device: torch.device) -> dict[str, float]:
    """The bandwidths a bench's floor may divide by: measured (``copy_bandwidth_tb_s``) and, for a
    card in the table, the datasheet's (``spec_bandwidth_tb_s``); on CUDA also the measured bf16
    GEMM roof (``gemm_tflops``) a prefill step is held against."""
    figures = {"copy_bandwidth_tb_s": copy_bandwidth(device) / 1e12}
    if device.type == "cuda":
        figures["gemm_tflops"] = gemm_tflops(device)
        if (spec := spec_bandwidth(torch.cuda.get_device_name(device))) is not None:
            figures["spec_bandwidth_tb_s"] = spec / 1e12
    return figures
