"""Rank 0 of a tensor-parallel engine: the model runner of the engine's own process, which spawns
ranks 1..N-1 and makes them follow its steps.

The engine calls it as any model runner. What changes the other ranks' state goes with the next
step, in the order rank 0 made it: adapter writes (``write_rows``: the cache's loads and evictions)
and KV block copies are applied here at once and queued; ``execute`` broadcasts them with the step's
sequences, then runs its own shard, the ranks' all-reduces keeping them in lockstep.

A rank that dies ends the engine: its exit is seen before a step (its process's exit code) or
inside one (a collective with it fails at once, its sockets closed; a rank that hangs fails it
after ``COLLECTIVE_TIMEOUT``). ``RankFailedError`` names the rank; the ranks left are stopped and
every later step raises the same error, so nothing waits on a group that lost a member.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

import serving

from serving.engine.config import EngineConfig
from serving.engine.distributed.parallel import SINGLE, RankFailedError, TensorParallel
from serving.engine.distributed.rank_worker import RankArgs
from serving.engine.distributed.step import AdapterWrite, StepMessage, describe
from serving.engine.lora.reader import Weights
from serving.engine.lora.records import CachedAdapter, CopyDone
from serving.engine.model_runner import ModelRunner, StepResult
from serving.engine.sequence import Sequence

# How long a failed collective waits for the rank that caused it to show as exited.
_EXIT_GRACE_S = 5.0


class DriverRunner(ModelRunner):
    def __init__(self, config: EngineConfig, hf_config: PretrainedConfig, max_model_len: int,
                 eos_token_ids: Collection[int] = ()) -> None:  # fmt: skip
        if dist.is_initialized():
            raise RuntimeError("this process already holds a torch.distributed group (another tensor-parallel "
                               "engine, not shut down): one tensor-parallel engine per process")  # fmt: skip
        size = config.tensor_parallel_size
        port = _free_port()
        self._ranks: dict[int, subprocess.Popen[bytes]] = {}
        self._failure: RankFailedError | None = None
        self._writes: list[tuple[AdapterWrite, Weights]] = []
        self._copies: list[tuple[int, int]] = []
        for rank in range(1, size):
            args = RankArgs(rank, size, port, config, hf_config, max_model_len, torch.get_num_threads())
            self._ranks[rank] = _spawn(args)
        self.tp = SINGLE
        try:
            self.tp = TensorParallel.join(0, size, port, config.torch_device)
            super().__init__(config, hf_config, max_model_len, eos_token_ids, tp=self.tp)
            self.tp.all_reduce_min(1)  # every rank has built its shard
        except RuntimeError as exc:  # a collective, or the rendezvous, failed
            raise self._fail(exc, "while starting") from exc
        except BaseException:  # rank 0's own error (a bad config): the others stop alike
            self._stop_ranks()
            self.tp.leave()
            raise
        # An engine never shut down (a script's LLM) still stops its ranks in order at exit, rather
        # than leaving them to find rank 0 gone.
        atexit.register(self.shutdown)

    # ---- what the other ranks must repeat ------------------------------------------------------

    def write_rows(self, slot: int, row: int, adapter: CachedAdapter) -> CopyDone | None:
        landed = super().write_rows(slot, row, adapter)
        weights = adapter.weights
        assert weights is not None  # super() checked it
        tensors = [(key, tuple(A.shape), tuple(Bt.shape)) for key, (A, Bt) in weights.items()]
        self._writes.append((AdapterWrite(slot, row, adapter.rank, adapter.scaling, adapter.digest, tensors), weights))
        return landed

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        super().copy_blocks(copies)
        self._copies += copies

    def execute(self, scheduled: list[tuple[Sequence, int]], *, flat: bool | None = None) -> StepResult:
        self._check()
        flat = self.runs_flat(scheduled) if flat is None else flat
        writes = self._writes
        message = StepMessage([write for write, _ in writes], self._copies, describe(scheduled), flat)
        self._writes, self._copies = [], []
        try:
            self.tp.broadcast_step(message)
            for write, weights in writes:
                for key, _, _ in write.tensors:
                    for tensor in weights[key]:
                        self.tp.broadcast_tensor(tensor)
            result = super().execute(scheduled, flat=flat)
            if not flat:  # the others answer logits requests after an eager step (TensorParallel.logits)
                self.tp.end_logits(self.device)
        except Exception as exc:
            raise self._fail(exc, "during a step") from exc
        return result

    # ---- the ranks' lives ---------------------------------------------------------------------

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure
        if any(p.poll() is not None for p in self._ranks.values()):
            raise self._fail(None, "between steps")

    def _fail(self, cause: BaseException | None, when: str) -> RankFailedError:
        """Stop the engine's ranks after ``cause`` (a failed collective, or None: a rank was seen
        exited); the error names the rank that died, or says that none did."""
        deadline = time.monotonic() + (_EXIT_GRACE_S if cause is not None else 0.0)
        while all(p.poll() is None for p in self._ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = {rank: p.returncode for rank, p in self._ranks.items() if p.returncode is not None}
        if dead:
            rank, code = min(dead.items())
            error = RankFailedError(rank, f"exited {when} ({_exit_reason(code)})")
        else:
            error = RankFailedError(0, f"failed {when}: {cause!r}; the ranks are out of step")
        self._failure = error
        self._stop_ranks()
        self.tp.leave()
        return error

    def _stop_ranks(self) -> None:
        for process in self._ranks.values():
            if process.poll() is None:
                process.terminate()
        for process in self._ranks.values():
            try:
                process.wait(_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def shutdown(self) -> None:
        """Stop the other ranks (they exit on the step message None) and leave the group."""
        atexit.unregister(self.shutdown)
        if self._failure is None:
            self._failure = RankFailedError(0, "was shut down")
            try:
                self.tp.broadcast_step(None)
            except RuntimeError:
                pass  # a rank already gone: it is stopped below all the same
            for process in self._ranks.values():
                try:
                    process.wait(_EXIT_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass  # stopped below
            self._stop_ranks()
            self.tp.leave()

    @property
    def rank_pids(self) -> dict[int, int]:
        """Each spawned rank's process id (for operators' logs, and tests that end one)."""
        return {rank: p.pid for rank, p in self._ranks.items()}


def _spawn(args: RankArgs) -> subprocess.Popen[bytes]:
    """Start rank ``args.rank`` in a fresh interpreter (rank_worker's docstring says why), the
    repository importable whatever the working directory."""
    root = str(Path(serving.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen([sys.executable, "-m", "serving.engine.distributed.rank_worker"], stdin=subprocess.PIPE,
                               env=env)  # fmt: skip
    assert process.stdin is not None
    with process.stdin:
        pickle.dump(args, process.stdin)
    return process


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _free_port() -> int:
    """A loopback port free now, for the group's rendezvous (the ranks connect within seconds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
