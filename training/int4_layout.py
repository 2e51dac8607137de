"""Which base models a QLoRA job (`base_quantization: "int4"`) can train on: the group size each
projection gets, and the base's shapes checked before a job is queued.

The INT4 training base (training.int4_base) stores every decoder projection in AWQ's layout
(kernels.int4): eight 4-bit columns to an int32 word, so a projection's output features must be a
multiple of 8, and one fp16 scale and 4-bit zero per group of input rows, the group a multiple of
16 (the kernels' K tile lies within one group). The group is 128, AWQ's usual one, or the largest
multiple of 16 below it that divides the input features (64 for a 64-wide tiny model).

Torch-free (the two numbers are kernels.int4's, asserted equal by the tests): the web process checks
a job against the base's safetensors headers without loading torch or the model.
"""

from __future__ import annotations

from collections.abc import Mapping

INT4 = "int4"
GROUP_SIZE = 128  # AWQ's usual group, and the largest taken
MIN_GROUP = 16  # kernels.int4.MIN_GROUP
PACK = 8  # kernels.int4.PACK: 4-bit columns a word


def group_size_for(in_features: int) -> int | None:
    """The group a projection of `in_features` inputs is quantized with; None: no group fits."""
    for group in range(GROUP_SIZE, MIN_GROUP - 1, -MIN_GROUP):
        if in_features % group == 0:
            return group
    return None


def projection_problem(name: str, out_features: int, in_features: int) -> str | None:
    """Why the projection `name` ([out, in], torch's weight shape) cannot be held in INT4; None when it can."""
    if group_size_for(in_features) is None:
        return f"{name} has {in_features} input features, not a multiple of {MIN_GROUP} (the INT4 group)"
    if out_features % PACK:
        return f"{name} has {out_features} output features, not a multiple of {PACK} (eight 4-bit columns a word)"
    return None


def layout_problem(shapes: Mapping[str, tuple[int, int]]) -> str | None:
    """Why a base whose decoder projections have these weight shapes ({name: (out, in)}) cannot be an
    INT4 training base; None when every one fits."""
    problems = [problem for name, (out_features, in_features) in sorted(shapes.items())
                if (problem := projection_problem(name, out_features, in_features)) is not None]
    return "; ".join(problems) or None


def int4_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one projection in INT4: the packed weight, the fp16 scales and the packed zeros."""
    group = group_size_for(in_features)
    if group is None:
        raise ValueError(f"{in_features} input features take no INT4 group")
    groups = in_features // group
    return in_features * out_features // 2 + groups * out_features * 2 + groups * out_features // 2
