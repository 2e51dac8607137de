"""A linear layer of the base model that also adds every adapter of the batch to its output.

The base weight exists once. Beside it, per output slice (q/k/v of a fused attention projection,
gate/up of a fused MLP one, or a single slice), the layer holds preallocated slot tensors
``A [max_loras, max_lora_rank, in]`` and ``B [max_loras, out_slice, max_lora_rank]``; loading an
adapter is a copy into one slot (smaller ranks zero-padded, modules an adapter does not target
left zero). The forward adds ``scaling[s] * B[s] @ A[s] @ x`` for each token's slot ``s`` through
``kernels.lora_apply_weights`` (slot tensors validated once, at ``bind_slots``), reading the step's
LoRA metadata from the per-step context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import LoRAWeights, lora_apply_weights
from serving.engine.context import get_context


class MultiLoRALinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        slices: list[tuple[str, int]],
        *,
        bias: bool,
        layer_idx: int,
        max_loras: int,
        max_lora_rank: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.slice_names = [name for name, _ in slices]
        widths = [width for _, width in slices]
        self.slice_offsets = [sum(widths[:i]) for i in range(len(widths))]
        self.slice_widths = widths
        out_features = sum(widths)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )
        self.lora_A: list[torch.Tensor] = []
        self.lora_B: list[torch.Tensor] = []
        if max_loras > 0:
            for width in widths:
                self.lora_A.append(torch.zeros(max_loras, max_lora_rank, in_features, device=device, dtype=dtype))
                self.lora_B.append(torch.zeros(max_loras, width, max_lora_rank, device=device, dtype=dtype))
        # Per slice and slot, the rank written last: rows and columns past it are zero.
        self._filled_rank = [[0] * max_loras for _ in widths]
        # The slots as the kernels take them, with the scalings and ranks every LoRA layer of the
        # model shares: set by the model runner through bind_slots.
        self.lora_weights: LoRAWeights | None = None

    def slice_of(self, name: str) -> tuple[int, int]:
        """``(offset, width)`` of slice ``name``'s rows in the fused weight."""
        i = self.slice_names.index(name)
        return self.slice_offsets[i], self.slice_widths[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        lora = get_context().lora
        if lora is not None and self.lora_weights is not None:
            lora_apply_weights(y, x, self.lora_weights, lora)
        return y

    def bind_slots(self, scaling: torch.Tensor, ranks: torch.Tensor) -> None:
        """Share the model's per-slot ``scaling [S]`` and ``ranks [S]`` and check the slots once."""
        self.lora_weights = LoRAWeights(self.lora_A, self.lora_B, scaling, self.slice_offsets, ranks=ranks)

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy one adapter's ``(A [r, in], B [out, r])`` per slice name into ``slot``; zero the rest.

        Only what the copy leaves uncovered is zeroed (the ranks past ``r``; a whole slice the
        adapter does not target, unless it is zero already), so a full-rank adapter on every
        module costs one copy per tensor: the hot-load's launches, not its bytes, dominate."""
        for i, (name, A, B) in enumerate(zip(self.slice_names, self.lora_A, self.lora_B)):
            if name in weights:
                a, b = weights[name]
                rank = a.shape[0]
                A[slot, :rank].copy_(a, non_blocking=True)
                B[slot, :, :rank].copy_(b, non_blocking=True)
                if rank < A.shape[1] and self._filled_rank[i][slot] > rank:
                    A[slot, rank:].zero_()
                    B[slot, :, rank:].zero_()
                self._filled_rank[i][slot] = rank
            elif self._filled_rank[i][slot]:
                A[slot].zero_()
                B[slot].zero_()
                self._filled_rank[i][slot] = 0
