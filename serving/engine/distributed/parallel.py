"""The process group of one tensor-parallel engine and the collectives its layers call.

Two groups span the same ranks. The *compute* group (gloo on CPU, NCCL on CUDA) carries what a
step's forward needs: the row-parallel all-reduces, the embedding's all-reduce and the LM head's
logits; it times out after ``COLLECTIVE_TIMEOUT``, so a rank that hangs mid-step ends the step with
an error instead of a hang. The *control* group (gloo) carries the step descriptions; ranks 1..N-1
wait on it while the engine is idle, for as long as it stays idle, so its timeout is effectively
none. A rank that dies closes its sockets, and every collective with it fails at once.

The LM head is vocabulary-parallel: each rank holds ``ceil(V / N)`` rows of it (the last rank's
padded), and the shards of a row's logits are gathered to rank 0. In a flat step every rank knows
the sampled rows, so each computes its shard and the gather is the only collective
(``gather_logits``). An eager step's logits are rank 0's to ask for (to sample, or a prompt's
logprobs, chunk by chunk), so there the other ranks follow a small protocol after the forward:
rank 0 broadcasts the row count (``-1``: the step is over) and the hidden rows, every rank
multiplies them by its shard, and the shards are gathered (``logits`` / ``serve_logits``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# How long a collective of a step may wait for a rank (a hung one: a dead one fails at once).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
# The control group's waits last as long as the engine is idle.
CONTROL_TIMEOUT = datetime.timedelta(days=30)


class RankFailedError(RuntimeError):
    """A rank of a tensor-parallel engine died or fell out of step: the engine cannot run another
    step (its group lost a member) and has stopped."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"tensor-parallel rank {rank} {detail}; the engine has stopped")
        self.rank = rank
        self.detail = detail

    def __reduce__(self) -> tuple[type[RankFailedError], tuple[int, str]]:
        # Rebuilt from its fields: it crosses from the engine-core process to the server's.
        return type(self), (self.rank, self.detail)


class TensorParallel:
    """This process's rank in its engine's group of ``size`` ranks; size 1 does no communication."""

    def __init__(self, rank: int = 0, size: int = 1, control: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.control = control  # the control group (None where no group was joined: SINGLE)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the process that schedules and samples."""
        return self.rank == 0

    @classmethod
    def join(cls, rank: int, size: int, port: int, device: torch.device) -> TensorParallel:
        """Join the engine's group as ``rank`` (rendezvous on loopback ``port``)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
        return cls(rank, size, dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))

    def leave(self) -> None:
        # A joined group of one (the driver at size 1) is left too: the process may start another.
        if self.control is not None and dist.is_initialized():
            dist.destroy_process_group()

    # ---- the forward's collectives ------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(tensor)
        return tensor

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the memory budget: every rank sizes alike)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self._device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    # ---- the LM head's logits -----------------------------------------------------------------

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank: its ``[rows, V / N]`` shard of the same rows' logits in; rank 0 gets the
        full ``[rows, vocab_size]``, the others their shard back."""
        if self.size == 1:
            return local[:, :vocab_size]
        local = local.contiguous()
        if not self.is_driver:
            dist.gather(local, dst=0)
            return local
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def logits(self, hidden: torch.Tensor, shard: Callable[[torch.Tensor], torch.Tensor], vocab_size: int) -> torch.Tensor:
        """Rank 0, alone: the full ``[rows, vocab_size]`` logits of ``hidden``; ``shard(hidden)`` is
        this rank's ``[rows, V / N]`` part. The other ranks answer in ``serve_logits``."""
        if self.size > 1:
            hidden = hidden.contiguous()
            dist.broadcast(torch.tensor([hidden.shape[0]], dtype=torch.int64, device=hidden.device), src=0)
            dist.broadcast(hidden, src=0)
        return self.gather_logits(shard(hidden), vocab_size)

    def end_logits(self, device: torch.device) -> None:
        """Rank 0: the step asks for no more logits."""
        if self.size > 1:
            dist.broadcast(torch.tensor([-1], dtype=torch.int64, device=device), src=0)

    def serve_logits(self, shard: Callable[[torch.Tensor], torch.Tensor], hidden_size: int, dtype: torch.dtype,
                     device: torch.device) -> None:  # fmt: skip
        """Ranks 1..N-1: answer rank 0's ``logits`` calls until it ends the step."""
        header = torch.empty(1, dtype=torch.int64, device=device)
        while True:
            dist.broadcast(header, src=0)
            rows = int(header.item())
            if rows < 0:
                return
            hidden = torch.empty(rows, hidden_size, dtype=dtype, device=device)
            dist.broadcast(hidden, src=0)
            self.gather_logits(shard(hidden), 0)

    # ---- steps --------------------------------------------------------------------------------

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """Rank 0: send ``tensor`` to every rank over the compute group (on its device)."""
        dist.broadcast(tensor.to(self._device()), src=0)

    def receive_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Ranks 1..N-1: the tensor rank 0 sends next (``broadcast_tensor``), on the compute device."""
        tensor = torch.empty(shape, dtype=dtype, device=self._device())
        dist.broadcast(tensor, src=0)
        return tensor

    def broadcast_step(self, message: object) -> object:
        """Rank 0 sends ``message`` to every rank (pickled); the others pass None and get it."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


SINGLE = TensorParallel()
