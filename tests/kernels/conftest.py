"""Kernel tests run the Triton kernels through Triton's interpreter on machines without CUDA.

Triton decides between compiling and interpreting when a kernel is defined, so TRITON_INTERPRET
must be set before ``kernels.triton_lora`` is first imported; ``kernels`` imports it lazily (only
when the Triton backend runs), and this file sets the variable at collection time. On a CUDA
machine it is left unset: there the same tests run the compiled kernels.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
