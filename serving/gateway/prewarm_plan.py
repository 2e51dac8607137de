"""Where the predicted adapters go: which worker prefetches which version, into a GPU slot or
only its CPU cache (the prewarm loop sends the plan; serving.gateway.prewarm_loop).

The versions come ranked, most wanted first (serving.gateway.prewarm's demand model). The first
as many as there are slots over all workers are meant for slots: those already in a slot stay in
it; each of the others goes to a worker that holds it in its CPU cache while that worker has slots
left in this plan, else to the worker with the most slots left, so new placements spread over the
workers. The following versions go to CPU caches the same way, until those are planned full; the
rest of the ranking is left to on-demand loading. A worker's CPU cache also holds a copy of what
its slots hold, so slot placements count against it too. Each version gets one worker.

A CPU-only placement that would need a storage read (the chosen worker holds the version in
neither a slot nor its CPU cache) is planned only for the `readable` versions, those whose
predicted requests justify a read (the loop decides: serving.gateway.prewarm_loop); the others are
left to on-demand loading. Such reads are speculative CPU work on the worker (digest check,
deserialisation) that competes with its requests, and over a long tail they mostly evict each
other unread (docs/resilience.md, "Predictive prewarm").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from serving.gateway.routing import WorkerView


@dataclass(frozen=True)
class Placement:
    name: str
    to_gpu: bool


def plan_prefetch(ranked: Sequence[str], workers: Sequence[WorkerView],
                  readable: Collection[str] | None = None) -> dict[str, list[Placement]]:
    """worker_id → its placements, most wanted first (workers with nothing to do are left out).
    `readable`: the versions a CPU-only placement may read from storage (None: all)."""
    gpu_left = {w.worker_id: w.max_loras for w in workers}
    cpu_left = {w.worker_id: max(w.max_cpu_loras, w.max_loras) for w in workers}
    gpu_names = list(dict.fromkeys(ranked))[:sum(gpu_left.values())]
    chosen: dict[str, tuple[str, bool]] = {}
    # What is in a slot and stays wanted in one keeps its slot (no worker evicts it for another).
    for name in gpu_names:
        holder = next((w for w in workers if w.adapters.get(name) == "gpu" and gpu_left[w.worker_id] > 0), None)
        if holder is not None:
            chosen[name] = (holder.worker_id, True)
            gpu_left[holder.worker_id] -= 1
            cpu_left[holder.worker_id] -= 1
    for name in dict.fromkeys(ranked):
        if name in chosen:
            continue
        to_gpu = name in gpu_names
        budget = gpu_left if to_gpu else cpu_left
        open_workers = [w for w in workers if budget[w.worker_id] > 0 and cpu_left[w.worker_id] > 0]
        if not open_workers:
            if to_gpu:
                continue
            break
        holders = [w for w in open_workers if name in w.adapters]
        # The first of the emptiest: ties go to the workers' order.
        target = holders[0] if holders else max(open_workers, key=lambda w: budget[w.worker_id])
        if not to_gpu and readable is not None and name not in readable \
                and target.adapters.get(name) not in ("gpu", "cpu"):
            continue
        chosen[name] = (target.worker_id, to_gpu)
        cpu_left[target.worker_id] -= 1
        if to_gpu:
            gpu_left[target.worker_id] -= 1
    plan: dict[str, list[Placement]] = {}
    for name in dict.fromkeys(ranked):
        if name in chosen:
            worker_id, to_gpu = chosen[name]
            plan.setdefault(worker_id, []).append(Placement(name=name, to_gpu=to_gpu))
    return plan
