"""How a tensor-parallel rank's share of each projection is cut (vLLM's layout; docs/serving-worker.md,
"Tensor parallelism").

- *Column-parallel* (q/k/v, gate/up): each rank keeps some output rows of the weight (and bias), its
  query heads, KV heads and MLP columns. For an adapter on it: all of A and the same rows of B, so
  the rank's LoRA output is exactly its columns of the whole adapter's.
- *Row-parallel* (o, down): each rank keeps the input columns its column-parallel partner produced;
  its output is a partial sum, all-reduced once. For an adapter: those columns of A and all of B.
  ``B (A x) = sum over ranks of B (A_r x_r)``, so the expand of each rank's partial shrink is added to
  the partial output and the one all-reduce of the output sums the adapter's too: no all-reduce of
  its own, exact up to fp32 summation order. The bias is added once, after the all-reduce.
- Query heads are split evenly; KV heads too, or, with fewer KV heads than ranks, each rank keeps
  the one KV head its query heads read (replicated on ``N / num_kv_heads`` ranks).
- The vocabulary: ``ceil(V / N)`` embedding rows per rank (the last padded with zeros); a token's
  embedding comes from the rank that holds it, summed over ranks (the others add zeros).

Where a checkpoint fuses projections (Phi-3's qkv_proj and gate_up_proj, one LoRA slice each), a
rank keeps its rows of each part, in the same order, so its fused output splits as the layer expects.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine.distributed.parallel import TensorParallel


@dataclass(frozen=True)
class Split:
    """One projection's share on this rank: ``keep`` (column-parallel) the global output rows each
    slice keeps, in order; ``inputs`` (row-parallel) the input columns it keeps."""

    keep: Mapping[str, torch.Tensor] | None = None
    inputs: slice | None = None

    @property
    def reduces(self) -> bool:
        """Its output is a partial sum, all-reduced over the ranks."""
        return self.inputs is not None

    def checkpoint(self, slice_name: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (``kind``: "weight" ``[out, in]`` or "bias" ``[out]``)."""
        if self.keep is not None:
            return tensor.index_select(0, self.keep[slice_name])
        if self.inputs is not None and kind == "weight":
            return tensor[:, self.inputs]
        return tensor

    def adapter(self, slice_name: str, A: torch.Tensor, Bt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of an adapter's ``(A [rank, in], Bt [rank, out])`` on slice ``slice_name``."""
        if self.keep is not None:
            return A, Bt.index_select(1, self.keep[slice_name])
        if self.inputs is not None:
            return A[:, self.inputs], Bt
        return A, Bt


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one rank keeps: ``num_heads`` query heads from ``first_head``,
    ``num_kv_heads`` KV heads from ``first_kv_head``."""

    num_heads: int
    first_head: int
    num_kv_heads: int
    first_kv_head: int


def split_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadSplit:
    """Rank ``tp.rank``'s heads; a ValueError names a head count the size cannot split."""
    size, rank = tp.size, tp.rank
    if num_heads % size:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={size}")
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise ValueError(f"num_key_value_heads={num_kv_heads} is not divisible by tensor_parallel_size={size}")
        return HeadSplit(num_heads // size, rank * num_heads // size, num_kv_heads // size, rank * num_kv_heads // size)
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} is not a multiple of num_key_value_heads={num_kv_heads}, "
                         "so the KV heads cannot be replicated evenly")  # fmt: skip
    # Query heads [rank * H/N, ...) read KV head (rank * H/N) // (H/K) = rank // (N/K).
    return HeadSplit(num_heads // size, rank * num_heads // size, 1, rank // (size // num_kv_heads))


def rows(first: int, count: int, width: int, base: int = 0) -> torch.Tensor:
    """Global rows of ``count`` units of ``width`` from unit ``first``, offset by ``base``."""
    return torch.arange(base + first * width, base + (first + count) * width)


def even_share(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """``(first, count)`` of this rank's even share of ``total`` units (MLP columns)."""
    if total % tp.size:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={tp.size}")
    count = total // tp.size
    return tp.rank * count, count


class VocabParallelEmbedding(nn.Module):
    """``vocab_size`` embeddings, this rank holding ``ceil(V / N)`` rows of them; at size 1 a plain
    embedding. Its ``weight`` is the tied LM head's too."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, *, device: torch.device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.first = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, device=device, dtype=dtype), requires_grad=False)

    def checkpoint(self, tensor: torch.Tensor) -> torch.Tensor:
        return vocab_rows(tensor, self.first, self.per_rank)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """An untied LM head split by vocabulary rows as the embedding is."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, *, device: torch.device,
                 dtype: torch.dtype) -> None:  # fmt: skip
        super().__init__()
        per_rank = -(-vocab_size // tp.size)
        self.first, self.per_rank = tp.rank * per_rank, per_rank
        self.weight = nn.Parameter(torch.zeros(per_rank, hidden_size, device=device, dtype=dtype), requires_grad=False)

    def checkpoint(self, tensor: torch.Tensor) -> torch.Tensor:
        return vocab_rows(tensor, self.first, self.per_rank)


def vocab_rows(tensor: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Rows ``first .. first + count`` of a ``[V, hidden]`` checkpoint tensor, zero-padded past V."""
    part = tensor[first : first + count]
    if part.shape[0] == count:
        return part
    return torch.cat([part, part.new_zeros(count - part.shape[0], part.shape[1])])
