"""``triton.jit`` with a type: Triton ships no type information, so to mypy a function under the
bare decorator is untyped. The kernels use :func:`jit` instead, which returns the same object.

Kernel parameters are annotated ``tl.constexpr`` or ``tl.tensor`` (what every run-time argument is
inside a kernel), never ``int``, ``float`` or ``bool``: Triton reads those annotations as the
argument's fixed type (``int`` is i32) and stops specialising on them, which would change the
compiled kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar

import triton

P = ParamSpec("P")
R = TypeVar("R", covariant=True)

# A launch grid: programs along each axis.
Grid = tuple[int, ...]


class JITFunction(Protocol[P, R]):
    """A ``@jit`` function: called inside another kernel with its own signature (the compiler
    inlines it), or launched from the host as ``kernel[grid](*args, num_warps=..., ...)`` with torch
    tensors where the kernel takes pointers (so the launch's arguments are not its parameters)."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def __getitem__(self, grid: Grid) -> Callable[..., object]: ...


def jit(fn: Callable[P, R]) -> JITFunction[P, R]:
    """``triton.jit(fn)`` (an interpreted function when ``TRITON_INTERPRET=1`` was set)."""
    kernel: JITFunction[P, R] = triton.jit(fn)
    return kernel
