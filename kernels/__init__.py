"""Multi-LoRA kernels: apply many adapters to one mixed batch in a single pass per layer.

Public API (depends on torch and triton only):

- :class:`LoRAMeta` — per-step metadata built once from the step's ``token_slots`` (int ``[T]``,
  values in ``[-1, S)``, ``-1`` = no adapter) and read by every LoRA layer of the step. Allocate it
  once with ``LoRAMeta(max_num_tokens, max_slots, device)`` and call ``meta.prepare(token_slots)``
  each step: buffers are fixed-size and updated in place, with no host synchronisation on CUDA, so
  a decode step can be captured in a CUDA graph.
- :func:`lora_apply` ``(y, x, A, B, scaling, meta, *, ranks=None, backend=None)`` —
  ``y[t] += scaling[s_t] * B[s_t] @ (A[s_t] @ x[t])`` in place for tokens with ``s_t >= 0``;
  ``A [S, R, K]``, ``B [S, N, R]``, ``scaling [S]``, optional ``ranks [S]`` int32 (slot ``s`` costs
  only its own rank; the zero padding beyond it must stay zero).
- :func:`lora_apply_sliced` ``(y, x, As, Bs, scaling, meta, slice_offsets=None, *, ranks=None,
  backend=None)`` — the same for a fused q/k/v or gate/up projection: slice ``i`` writes columns
  ``slice_offsets[i] : slice_offsets[i] + Bs[i].shape[1]`` of the packed ``y`` (1 to 3 slices).
- :class:`LoRAWeights` ``(As, Bs, scaling, slice_offsets=None, *, ranks=None, rows=None,
  max_rank=None)`` and :func:`lora_apply_weights` ``(y, x, weights, meta, *, backend=None)`` — the
  same with the adapter memory validated once (a layer whose memory is fixed for its life; the
  engine's). With ``rows`` (int32 ``[S]``) it is a *row pool*: ``As[i] [P, K]``, ``Bs[i] [P, N_i]``
  (B transposed), slot ``s`` owning pool rows ``rows[s] : rows[s] + ranks[s]`` (``ranks`` required),
  ``max_rank`` (required) sizing the kernels; memory then follows each adapter's own rank.
- :func:`use_backend` ``("auto" | "torch" | "triton")`` — context manager overriding dispatch
  (``"auto"``: Triton on CUDA tensors, the torch CPU backend elsewhere).

Numerics and tolerances are described in docs/kernels.md.
"""

from kernels.apply import (
    BACKENDS,
    MAX_SLICES,
    LoRAWeights,
    lora_apply,
    lora_apply_sliced,
    lora_apply_weights,
    resolve_backend,
    use_backend,
)
from kernels.meta import LoRAMeta

__all__ = [
    "BACKENDS",
    "MAX_SLICES",
    "LoRAMeta",
    "LoRAWeights",
    "lora_apply",
    "lora_apply_sliced",
    "lora_apply_weights",
    "resolve_backend",
    "use_backend",
]
