"""Tensor parallelism for the engine (docs/serving-worker.md, "Tensor parallelism").

One process per rank under ``torch.distributed`` (gloo on CPU, NCCL on CUDA): rank 0 is the
engine's own process and runs the scheduler, the adapter cache and the sampler; ranks 1..N-1 are
spawned by it and run their shard of the model, step by step, as rank 0 describes each step.

- ``parallel``: the process group of one engine and its collectives (``TensorParallel``).
- ``step``: what rank 0 broadcasts per step (the scheduled sequences, KV copies, adapter writes).
- ``driver``: rank 0's side (``DriverRunner``): spawns the ranks, broadcasts steps, ends the engine
  with ``RankFailedError`` when a rank dies.
- ``rank_worker``: ranks 1..N-1 (their process's entry point and step loop).
"""
