"""Which serving worker gets a request: live workers from the Redis worker registry, scored as the
Gateway API Inference Extension's endpoint picker scores them.

score = w_affinity · affinity − w_queue · queue / max(queue) − w_kv · kv / max(kv)

- affinity of the requested adapter: 1.0 resident in a GPU slot, 0.8 a free GPU slot (it loads
  without evicting anyone), 0.6 in the CPU cache or loading, 0 otherwise; the base model is 1.0
  everywhere;
- queue: the worker's reported waiting requests plus the requests this gateway process has in
  flight there now (heartbeats are seconds old: without the local count a burst would all land on
  the worker that looked idle at its last heartbeat);
- kv: the worker's reported KV-cache use;
both normalised by their maximum over the candidates. Ties are broken at random.

A worker is a candidate when its heartbeat is younger than its TTL, its state is `ready`, and it
serves the platform's base model. The key layout is the wire's (serving.contracts.registry), which the worker writes.

GATEWAY_ROUTING=round_robin (RoutingConfig) replaces the scoring by turns: each request goes to the
live worker after the last one picked, blind to adapters and load. It is the baseline that
bench/fleet.py measures affinity against, and a fallback should the scoring ever misbehave.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import redis.asyncio as aioredis
from pydantic import field_validator

from serving.gateway.failover import ranked
from runtime.env import EnvModel, env
from serving.contracts.registry import WORKERS_KEY, worker_key

AFFINITY_GPU = 1.0
AFFINITY_FREE_SLOT = 0.8
AFFINITY_CPU = 0.6

# The routing policies (GATEWAY_ROUTING).
AFFINITY = "affinity"
ROUND_ROBIN = "round_robin"


class Weights(EnvModel):
    """Worker scoring's weights of affinity, queue and KV cache (the endpoint picker's defaults;
    read with the policy by RoutingConfig)."""

    affinity: float = env(1.0, "GATEWAY_WEIGHT_AFFINITY")
    queue: float = env(2.0, "GATEWAY_WEIGHT_QUEUE")
    kv: float = env(2.0, "GATEWAY_WEIGHT_KV")


class RoutingConfig(EnvModel):
    """How a worker is picked (settings.GATEWAY_ROUTING, built once): the policy and affinity's
    scoring weights."""

    policy: Literal["affinity", "round_robin"] = env(AFFINITY, "GATEWAY_ROUTING")
    weights: Weights = Weights()

    @field_validator("policy", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


@dataclass(frozen=True)
class WorkerView:
    """What the gateway knows of one worker from its registry entry."""

    worker_id: str
    url: str
    base_model: str
    served_model_names: tuple[str, ...]
    max_loras: int
    max_model_len: int | None
    queue_depth: int
    kv_cache_usage: float
    # name → "gpu" | "cpu" | "loaded" (a name whose weights are neither in a slot nor in the cache)
    adapters: Mapping[str, str] = field(default_factory=dict)
    # For resilience (serving.gateway.resilience): the process's start (a restart is a new
    # instance for outlier ejection) and its saturation figures for load shedding, when reported.
    started_at: float = 0.0
    max_queued_requests: int | None = None
    gpu_memory_free_bytes: int | None = None
    # The CPU cache under the slots (the prewarm loop fills both; serving.gateway.prewarm_plan).
    max_cpu_loras: int = 0
    # The devices its engine spans (one registered worker at any size); 1 when an older worker omits it.
    tensor_parallel_size: int = 1

    @classmethod
    def parse(cls, document: Mapping[str, Any]) -> WorkerView:
        adapters = {}
        for entry in document.get("adapters") or []:
            adapters[str(entry["name"])] = "gpu" if entry.get("gpu") else "cpu" if entry.get("cpu") else "loaded"
        return cls(
            worker_id=str(document["worker_id"]),
            url=str(document["url"]).rstrip("/"),
            base_model=str(document["base_model"]),
            served_model_names=tuple(document.get("served_model_names") or [document["base_model"]]),
            max_loras=int(document.get("max_loras") or 0),
            max_model_len=document.get("max_model_len"),
            queue_depth=int(document.get("queue_depth") or 0),
            kv_cache_usage=float(document.get("kv_cache_usage") or 0.0),
            adapters=adapters,
            started_at=float(document.get("started_at") or 0.0),
            max_queued_requests=_optional_int(document.get("max_queued_requests")),
            gpu_memory_free_bytes=_optional_int(document.get("gpu_memory_free_bytes")),
            max_cpu_loras=int(document.get("max_cpu_loras") or 0),
            tensor_parallel_size=int(document.get("tensor_parallel_size") or 1),
        )

    def affinity(self, adapter: str | None) -> float:
        if adapter is None:
            return AFFINITY_GPU
        where = self.adapters.get(adapter)
        if where == "gpu":
            return AFFINITY_GPU
        gpu_used = sum(1 for place in self.adapters.values() if place == "gpu")
        if gpu_used < self.max_loras:
            return AFFINITY_FREE_SLOT
        if where is not None:
            return AFFINITY_CPU
        return 0.0


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def live_workers(documents: Iterable[Mapping[str, Any]], *, base_models: Iterable[str], key_id: str | None,
                 now: float | None = None) -> list[WorkerView]:
    """The workers a request may go to: fresh heartbeat, ready, serving one of `base_models`, and
    accepting the gateway's key (`key_id`, serving.contracts.registry.api_key_id: same key, or a worker without one)."""
    now = time.time() if now is None else now
    wanted = set(base_models)
    views = []
    for document in documents:
        try:
            fresh = float(document["heartbeat_at"]) + float(document.get("ttl") or 15) > now
            if not fresh or document.get("state") != "ready":
                continue
            if document.get("api_key_id") not in (None, key_id):
                continue  # it would refuse our key: another deployment's worker, or a misconfigured one
            view = WorkerView.parse(document)
        except (KeyError, TypeError, ValueError):
            continue  # a malformed entry is no worker to route to
        if wanted.intersection((view.base_model, *view.served_model_names)):
            views.append(view)
    return views


def score_workers(candidates: list[WorkerView], *, adapter: str | None, inflight: Mapping[str, int],
                  weights: Weights = Weights()) -> list[tuple[float, WorkerView]]:
    """(score, worker) for every candidate, in the candidates' order."""
    queues = [worker.queue_depth + inflight.get(worker.worker_id, 0) for worker in candidates]
    kvs = [worker.kv_cache_usage for worker in candidates]
    max_queue = max(queues, default=0) or 1
    max_kv = max(kvs, default=0.0) or 1.0
    return [
        (weights.affinity * worker.affinity(adapter) - weights.queue * queue / max_queue - weights.kv * kv / max_kv,
         worker)
        for worker, queue, kv in zip(candidates, queues, kvs)
    ]


def pick_worker(candidates: list[WorkerView], *, adapter: str | None, inflight: Mapping[str, int],
                weights: Weights = Weights(), rng: random.Random | None = None) -> WorkerView | None:
    """The best-scored candidate (a random one among equals); None when there is none."""
    if not candidates:
        return None
    scored = score_workers(candidates, adapter=adapter, inflight=inflight, weights=weights)
    best = max(score for score, _ in scored)
    top = [worker for score, worker in scored if score >= best - 1e-9]
    return top[0] if len(top) == 1 else (rng or random).choice(top)


class RoundRobin:
    """Turns over whichever workers are live at each pick: the first worker id after the last one
    picked, in id order, wrapping around. Keyed by id rather than by position, a worker that left
    is skipped and one that joined takes its turn without the others' turns shifting. One per
    gateway event loop (serving.gateway.resources.Resources): several processes each keep their
    own turn."""

    def __init__(self) -> None:
        self.last: str | None = None

    def turns(self, candidates: list[WorkerView]) -> list[WorkerView]:
        """The candidates from the one whose turn it is (now taken) onward, wrapping around."""
        ordered = sorted(candidates, key=lambda worker: worker.worker_id)
        if not ordered:
            return []
        last = self.last
        start = next((index for index, worker in enumerate(ordered) if last is None or worker.worker_id > last), 0)
        ordered = ordered[start:] + ordered[:start]
        self.last = ordered[0].worker_id
        return ordered


def route(candidates: list[WorkerView], *, adapter: str | None, inflight: Mapping[str, int], config: RoutingConfig,
          rotation: RoundRobin) -> list[WorkerView]:
    """The workers to try, in order: the pick first, then the fallbacks (serving.gateway.failover);
    empty when there is no candidate. Affinity: the best-scored, then the rest best first; round
    robin: the one whose turn it is, then the next ones in turn."""
    if config.policy == ROUND_ROBIN:
        return rotation.turns(candidates)
    worker = pick_worker(candidates, adapter=adapter, inflight=inflight, weights=config.weights)
    if worker is None:
        return []
    scored = score_workers(candidates, adapter=adapter, inflight=inflight, weights=config.weights)
    return [worker, *(other for other in ranked(scored) if other.worker_id != worker.worker_id)]


async def read_registry(client: aioredis.Redis, *, now: float | None = None) -> list[dict[str, Any]]:
    """Every registry document of a worker whose heartbeat is recent (one round trip each way)."""
    now = time.time() if now is None else now
    # Members older than the longest TTL a worker uses are stale; the documents' own TTL decides.
    ids = cast("list[bytes | str]", await client.zrangebyscore(WORKERS_KEY, now - 600, "+inf"))  # no scores
    if not ids:
        return []
    raw = await client.mget([worker_key(item.decode() if isinstance(item, bytes) else item) for item in ids])
    documents = []
    for item in raw:
        if item is None:
            continue
        try:
            documents.append(json.loads(item))
        except ValueError:
            continue
    return documents
