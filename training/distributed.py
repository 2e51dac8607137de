"""Several GPUs for one job: its ranks, their process group, and the collectives the trainer needs.

Rank 0 is the Celery task's own process (training.run): it keeps the job's lease, heartbeat,
hooks, checkpoints and publish, as a one-GPU run does. `launch` starts ranks 1…N-1 as
subprocesses (`python -m training.ranks`) that only compute: they receive the run's inputs from
rank 0, follow its decisions (stop, pause) and write nothing. Subprocesses and not
torch.multiprocessing: a Celery prefork pool process is daemonic, and multiprocessing refuses
children to a daemonic process. NCCL on CUDA, gloo on CPU; nothing else differs.

Sharding. `shard` applies FSDP2 (`fully_shard`) to every decoder layer and to the whole model,
with the LoRA parameters left out (`ignored_params`): the frozen base is split across the ranks
and gathered layer by layer in the forward (and again in the backward), while the LoRA weights,
a few MB, are whole on every rank. Their gradients are summed over the ranks here
(`reduce_gradients`), every rank steps the same AdamW on the same values, and a checkpoint is rank
0's plain PEFT state and optimizer state: the same files as a one-process run writes, so a
checkpoint resumes at any world size and the publish is unchanged.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

# A collective waits this long for the other ranks (rank 0 may be uploading a checkpoint meanwhile).
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# The environment a rank ≥ 1 reads (torchrun's names, plus the store rank 0 opened).
ENV_RANK, ENV_WORLD_SIZE, ENV_STORE, ENV_PARENT = "RANK", "WORLD_SIZE", "LORAPLEX_RANK_STORE", "LORAPLEX_RANK_PARENT"
_PR_SET_PDEATHSIG = 1
# After the last step a rank ≥ 1 has only its own exit left to do.
ENDING_SECONDS = 60.0
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class World:
    """This process's place among the job's ranks."""

    rank: int
    size: int
    device: torch.device
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (pickled; for the run's inputs and its restored state)."""
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def broadcast_params(self, params: Sequence[torch.nn.Parameter]) -> None:
        for param in params:
            dist.broadcast(param.data, src=0)

    def agree(self, stop: bool, interrupt: bool) -> tuple[bool, bool]:
        """Rank 0's decisions before a step (cancel, a pause or the worker's stop), on every rank."""
        flags = torch.tensor([stop, interrupt], dtype=torch.int32, device=self.device)
        dist.broadcast(flags, src=0)
        return bool(flags[0]), bool(flags[1])

    def sum(self, values: Sequence[float]) -> list[float]:
        """The values summed over the ranks (a step's loss and counts)."""
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Each LoRA gradient summed over the ranks, in one flat all-reduce."""
        grads = [param.grad if param.grad is not None else torch.zeros_like(param) for param in params]
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat)
        offset = 0
        for param, grad in zip(params, grads):
            param.grad = flat[offset:offset + grad.numel()].view_as(grad).clone()
            offset += grad.numel()

    def seed_step(self, seed: int, step: int) -> None:
        """Dropout's RNG for a step, from the job's seed, the step and the rank: a resumed run draws
        what the uninterrupted one drew without a checkpoint holding every rank's RNG state."""
        torch.manual_seed((seed * 1_000_003 + step) * 4099 + self.rank)


def shard(model: torch.nn.Module, base: torch.nn.Module, world: World) -> None:
    """FSDP2 over the frozen base (module docstring), one unit per decoder layer (the classes
    transformers keeps whole, `_no_split_modules`) and the rest; the LoRA weights on the rank's device."""
    trainable = {param for param in model.parameters() if param.requires_grad}
    for param in trainable:
        param.data = param.data.to(world.device)
    mesh = init_device_mesh(world.device.type, (world.size,))
    whole = set(getattr(base, "_no_split_modules", None) or ())
    for layer in [module for module in base.modules() if type(module).__name__ in whole]:
        fully_shard(layer, mesh=mesh, ignored_params=trainable)
    fully_shard(model, mesh=mesh, ignored_params=trainable)


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")


def _init(store: dist.Store, rank: int, size: int) -> World:
    device = _device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    return World(rank=rank, size=size, device=device)


def _die_with_parent(parent: int) -> None:
    """This rank killed when rank 0's process ends, however it ends (Linux). Set here rather than in
    a Popen preexec_fn, which may deadlock in a process with threads (the run's heartbeat); a parent
    gone before it was set is caught by the check after it."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        raise SystemExit(f"rank 0 (process {parent}) ended before this rank started")


@contextmanager
def launch(size: int) -> Iterator[World]:
    """This process as rank 0 of `size`, the others started as subprocesses; they are ended on exit."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               **{ENV_WORLD_SIZE: str(size), ENV_STORE: str(store.port), ENV_PARENT: str(os.getpid())})
    children = [subprocess.Popen([sys.executable, "-m", "training.ranks"], env={**env, ENV_RANK: str(rank)},
                                 cwd=REPO_ROOT, start_new_session=True)
                for rank in range(1, size)]
    ended = False
    try:
        _wait_joined(store, children)
        world = _init(store, 0, size)
        world.children = children
        yield world
        ended = True
    finally:
        for child in children:
            _end(child, wait=ENDING_SECONDS if ended else 0)
        if dist.is_initialized():
            dist.destroy_process_group()


def _wait_joined(store: dist.Store, children: list[subprocess.Popen[bytes]]) -> None:
    """Until every rank has reached the store. A rank that exits first (its start failed) is named at
    once: the process group's rendezvous would wait the whole timeout for it."""
    keys = [f"joined/{rank}" for rank in range(1, len(children) + 1)]
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, child in enumerate(children, start=1):
            if child.poll() is not None:
                raise RuntimeError(f"Training rank {rank} exited with code {child.returncode} before joining rank 0 "
                                   "(its log is in the worker's).")
        if time.monotonic() > deadline:
            raise TimeoutError(f"The training ranks did not join rank 0 within {COLLECTIVE_TIMEOUT}.")
        time.sleep(0.1)


def _end(child: subprocess.Popen[bytes], wait: float) -> None:
    """A rank's process ended: given `wait` seconds to leave after a finished run, killed after a failed one."""
    try:
        child.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        pass
    if child.poll() is None:
        child.kill()
        child.wait()


def join() -> World:
    """A rank ≥ 1 (started by `launch`) joins rank 0's process group."""
    _die_with_parent(int(os.environ[ENV_PARENT]))
    rank, size = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD_SIZE])
    store = dist.TCPStore("127.0.0.1", int(os.environ[ENV_STORE]), size, is_master=False,
                          timeout=COLLECTIVE_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    return _init(store, rank, size)
