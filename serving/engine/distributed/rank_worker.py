"""Ranks 1..N-1 of a tensor-parallel engine: a process rank 0 spawned, holding its shard of the
model, its share of the KV cache and of every adapter, and no scheduler.

``python -m serving.engine.distributed.rank_worker`` reads its ``RankArgs`` pickled on stdin (from
rank 0, its parent). A fresh interpreter rather than multiprocessing's spawn, which re-imports the
parent's main module: the worker's ``python -m serving.engine.server`` would start a server again.

It joins the group, builds its model runner, says so (one all-reduce rank 0 waits on), then runs
each step rank 0 broadcasts: the adapter writes and KV copies first, then the forward on exactly
the tokens rank 0 runs, then the logits rank 0 asks for. ``None`` ends it; so does rank 0 going
away (its sockets close and the wait for the next step fails), so no rank outlives its engine.
"""

from __future__ import annotations

import logging
import pickle
import sys
from dataclasses import dataclass, replace
from typing import cast

import torch
from transformers import PretrainedConfig

from serving.engine.config import EngineConfig
from serving.engine.distributed.parallel import TensorParallel
from serving.engine.distributed.step import StepMessage
from serving.engine.lora.reader import Weights
from serving.engine.lora.records import CachedAdapter
from serving.engine.model_runner import ModelRunner
from serving.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankArgs:
    rank: int
    size: int
    port: int
    config: EngineConfig
    hf_config: PretrainedConfig
    max_model_len: int
    num_threads: int  # torch's intra-op threads, as rank 0 runs with


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """``config`` for ``rank``: on CUDA its own device, ``cuda:<rank>``."""
    if config.torch_device.type != "cuda":
        return config
    return replace(config, device=f"cuda:{rank}")


def run_rank(args: RankArgs) -> None:
    """The spawned process's entry point."""
    torch.set_num_threads(args.num_threads)
    config = rank_config(args.config, args.rank)
    if config.torch_device.type == "cuda":
        torch.cuda.set_device(config.torch_device)
    tp = TensorParallel.join(args.rank, args.size, args.port, config.torch_device)
    try:
        runner = ModelRunner(config, args.hf_config, args.max_model_len, tp=tp)
        tp.all_reduce_min(1)  # this shard is built: rank 0's start waits for every rank's
        while True:
            try:
                message = tp.broadcast_step(None)
            except RuntimeError as exc:
                log.error("tensor-parallel rank %d: rank 0 went away (%s); exiting", args.rank, exc)
                raise SystemExit(1) from None
            if message is None:
                return
            run_step(runner, cast(StepMessage, message))
    finally:
        tp.leave()


def run_step(runner: ModelRunner, message: StepMessage) -> None:
    """One step of rank 0's, on this rank's shard."""
    tp = runner.tp
    for write in message.writes:
        weights: Weights = {}
        for key, a_shape, b_shape in write.tensors:  # the order rank 0 sends them in
            a = tp.receive_tensor(a_shape, runner.dtype)
            weights[key] = (a, tp.receive_tensor(b_shape, runner.dtype))
        adapter = CachedAdapter(digest=write.digest, path="", rank=write.rank, lora_alpha=0.0, scaling=write.scaling,
                                target_modules=(), weights=weights, load_seconds=0.0)  # fmt: skip
        if runner.write_rows(write.slot, write.row, adapter) is not None:
            # Rank 0 admits no request to the rows before its own copy lands; here the forward
            # follows at once, so the copy must have landed first.
            torch.cuda.synchronize(runner.device)
    runner.copy_blocks(message.copies)
    # The runner reads only StepSeq's fields of a Sequence (step.py), and samples nothing here.
    runner.execute(cast(list[tuple[Sequence, int]], message.scheduled), flat=message.flat)
    if not message.flat:  # a flat step gathered its sampled rows' logits inside the forward
        config = runner.model.config
        tp.serve_logits(runner.model.logits_shard, config.hidden_size, runner.dtype, runner.device)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = pickle.load(sys.stdin.buffer)  # from our parent, rank 0
    sys.stdin.close()
    run_rank(args)


if __name__ == "__main__":
    main()
