"""The serving worker's life: the engine loads in the background while the HTTP server already
answers (`/health` says 503 until it is ready), requests are admitted against a bound, and on
SIGTERM the worker drains: it stops taking work, gives in-flight requests the grace period, aborts
what is left (their responses end properly, with `finish_reason: "abort"`), and leaves Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from enum import Enum
from typing import Any

import torch

from serving.engine import AsyncEngine, EngineClient, EngineConfig, EngineDeadError, EngineStats, ProcessEngine
from serving.engine.guided import GrammarBudget
from serving.engine.server.adapters import AdapterSet, Source
from serving.engine.server.chat_template_sandbox import ChatTemplateSandbox
from serving.engine.server.cli import ServerArgs, adapter_roots
from serving.engine.server.errors import APIError, overloaded
from serving.engine.server.http_warmup import WARMING, HttpWarmCall
from serving.engine.server.metrics import ServerMetrics
from serving.engine.server.registry_sync import RegistrySync
from serving.engine.server.slot_guard import SlotGuard
from serving.engine.server.waiting_room import WaitingRoom
from serving.engine.server.worker_registry import WorkerRegistration
from serving.engine.warmup import WarmupReport
from serving.contracts.registry import api_key_id

log = logging.getLogger(__name__)


class State(str, Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


def engine_config(args: ServerArgs) -> EngineConfig:
    """The engine's settings from the command line; raises ValueError naming a bad value."""
    config = EngineConfig(
        model=args.model,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        lora_memory_bytes=args.lora_memory_bytes,
        lora_memory_fraction=args.lora_memory_fraction,
        cpu_lora_cache_bytes=args.cpu_lora_cache_bytes,
        lora_prefetch_groups=args.lora_prefetch_groups,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_kv_blocks=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_dora=args.enable_dora,
        borrow_kv_memory=args.borrow_kv_memory,
        decode_stall_target=args.decode_stall_target,
        decode_stall_max_wait_steps=args.decode_stall_max_wait_steps,
        async_scheduling=bool(args.async_scheduling),
        quantization=args.quantization,
        grammar=GrammarBudget(timeout=args.grammar_compile_timeout, workers=args.grammar_compile_workers,
                              tenant_share=args.grammar_tenant_share, max_schema_depth=args.max_grammar_schema_depth),
    )
    if args.async_scheduling is None:
        # The worker's default: the overlap pays where a device runs the step while the host
        # schedules the next (on the H200, TPOT 16.6 -> 9.4 ms at 32 req/s); on CPU the host is the
        # device, and the ranks of a sharded model take the step's inputs from rank 0 in lockstep.
        config = dataclasses.replace(
            config, async_scheduling=config.torch_device.type == "cuda" and config.tensor_parallel_size == 1
        )
    return config


def uses_engine_process(asked: bool | None, device_type: str, tensor_parallel_size: int) -> bool:
    """--engine-process as given, else the worker's default: on for one CUDA device, where the engine
    thread and the HTTP loop contend for the interpreter lock (on the H200, 6,715 -> 9,800 output
    tok/s at capacity, docs/benchmarks.md); off on CPU, where the child only costs a second
    interpreter's start, and under tensor parallelism, whose ranks it has not been measured with."""
    if asked is not None:
        return asked
    return device_type == "cuda" and tensor_parallel_size == 1


def warms_up(asked: bool | None, device_type: str) -> bool:
    """--warmup as given, else the worker's default: on for CUDA, where the first requests would
    otherwise meet what the graph capture never ran (on the H100 the first rate after a start had a
    TTFT p50 of 1,929 ms against ~48 ms warm: issue 38); off on CPU, where a step compiles nothing
    and the warm-up would only delay the start (serving.engine.warmup)."""
    if asked is not None:
        return asked
    return device_type == "cuda"


class Worker:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.config = engine_config(args)
        self.engine_process = uses_engine_process(args.engine_process, self.config.torch_device.type,
                                                  self.config.tensor_parallel_size)
        self.base_model_ids = list(args.served_model_name) or [args.model]
        self.warms_up = warms_up(args.warmup, self.config.torch_device.type)
        # What the warm-up ran (None until it has, or without one): the worker is ready only after.
        self.warmup_report: WarmupReport | None = None
        # Set by the app (serving.engine.server.http_warmup): after the engine's warm-up, a few text
        # requests through the worker's own routes; what they got, once they have run.
        self.http_warmup: Callable[[], Awaitable[list[HttpWarmCall]]] | None = None
        self.http_warmup_calls: list[HttpWarmCall] | None = None
        self.state = State.LOADING
        self.engine: EngineClient | None = None
        self.adapters: AdapterSet | None = None
        self.adapter_roots = adapter_roots(args.allowed_adapter_path)
        # Callers' chat templates, when the operator allows them; a rendered prompt may be twice
        # the size of the largest body, which bounds what a template's loops can produce.
        self.chat_template_sandbox: ChatTemplateSandbox | None = None
        if args.trust_request_chat_template:
            self.chat_template_sandbox = ChatTemplateSandbox(
                timeout_s=args.chat_template_timeout, max_chars=2 * args.max_request_body_bytes)
        self.metrics = ServerMetrics()
        self.capacity = args.max_num_seqs + args.max_queued_requests
        self.started_at = time.time()
        self.exit_code = 0
        # Set by the server: ends the process when the worker cannot start.
        self.request_stop: Callable[[], None] = lambda: None
        self._inflight = WaitingRoom(self.capacity)
        self._tasks: set[asyncio.Task[None]] = set()
        self.registration: WorkerRegistration | None = None
        if args.redis_url:
            self.registration = WorkerRegistration(
                args.redis_url,
                worker_id=args.resolved_worker_id,
                interval=args.heartbeat_interval,
                describe=self.describe,
            )
        self.sync: RegistrySync | None = None
        self.slot_guard: SlotGuard | None = None
        # Why the engine stopped after the worker was ready (a tensor-parallel rank died).
        self.engine_failure: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def base_model_id(self) -> str:
        return self.base_model_ids[0]

    # ---- start and stop ------------------------------------------------------------------

    async def start(self) -> None:
        """Called once the HTTP server is up: load the engine in the background."""
        self._loop = asyncio.get_running_loop()
        self._spawn(self._boot(), "engine-boot")
        if self.registration is not None:
            self._spawn(self.registration.run(), "worker-heartbeat")

    async def _boot(self) -> None:
        try:
            log.info("loading %s; adapters may be loaded from %s", self.args.model, ", ".join(self.adapter_roots.roots))
            started = time.perf_counter()
            # --engine-process: the engine core in a child process, off this process's interpreter lock.
            engine_class: type[AsyncEngine | ProcessEngine] = ProcessEngine if self.engine_process else AsyncEngine
            self.engine = await asyncio.to_thread(engine_class, self.config, on_dead=self._engine_died)
            self.adapters = AdapterSet(self.engine, base_model_ids=self.base_model_ids, roots=self.adapter_roots,
                                       on_change=self._changed)
            for module in self.args.lora_modules:
                await self.adapters.load(module.name, module.path, load_inplace=False, source=Source.COMMAND_LINE)
            if self.warms_up:
                # Still loading to the outside (/health 503, the registry entry): every step shape
                # the scheduler can produce runs once first, with the --lora-modules in it.
                log.info("warming up: every step shape and sampler path once, with %d adapter(s)",
                         len(self.args.lora_modules))
                self.warmup_report = await self.engine.warm_up([module.name for module in self.args.lora_modules])
                log.info("%s", self.warmup_report.summary())
                if self.http_warmup is not None:
                    self.http_warmup_calls = await self.http_warmup()
                    refused = [f"{c.path} {c.model}: {c.status}" for c in self.http_warmup_calls if c.status != 200]
                    log.log(logging.WARNING if refused else logging.INFO, "HTTP warm-up: %d requests through the "
                            "routes%s", len(self.http_warmup_calls), f", refused: {'; '.join(refused)}" if refused else "")
        except Exception:
            log.exception("the worker could not start")
            self.state = State.FAILED
            self.exit_code = 1
            self.request_stop()
            return
        # What is loaded by now (torch, transformers, the model, the tokenizer) lives as long as the
        # process: frozen out of the collector, a full collection walks only what requests leave
        # (full collections took 131-143 ms about every 30 s under load, stalling every stream).
        gc.collect()
        gc.freeze()
        if self.state is State.LOADING:
            self.state = State.READY
        log.info(
            "ready in %.1fs: %s (max_model_len %d, %d adapter(s))",
            time.perf_counter() - started, self.base_model_id, self.engine.max_model_len, len(self.args.lora_modules),
        )
        self._changed()
        self.slot_guard = SlotGuard(self.engine, interval=self.args.slot_verify_interval, redis_url=self.args.redis_url,
                                    breaker_failures=self.metrics.slot_breaker_failures)
        self._spawn(self.slot_guard.run(), "slot-verify")
        if self.args.registry_url:
            self.sync = RegistrySync(
                self.adapters,
                snapshot_url=self.args.registry_url,
                token=self.args.registry_token or "",
                redis_url=self.args.redis_url,
                reconcile_interval=self.args.registry_reconcile_interval,
                base_revision=self.args.model_revision,
            )
            self._spawn(self.sync.run(), "registry-sync")

    def begin_drain(self) -> None:
        """SIGTERM: refuse new work, abort what is still running when the grace period ends."""
        if self.state is State.DRAINING:
            return
        log.info("draining: %d request(s) in flight get %.1fs", len(self._inflight), self.args.timeout_graceful_shutdown)
        self.state = State.DRAINING
        self._changed()
        self._spawn(self._abort_after(self.args.timeout_graceful_shutdown), "drain-deadline")

    async def _abort_after(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while self._inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._inflight and self.engine is not None:
            log.warning("grace period over: aborting %d request(s)", len(self._inflight))
            for request_id in list(self._inflight):
                await self.engine.abort(request_id)

    async def stop(self) -> None:
        """After the HTTP server stopped: leave Redis, stop background work, stop the engine."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.registration is not None:
            await self.registration.deregister()
        if self.chat_template_sandbox is not None:
            await self.chat_template_sandbox.close()
        if self.slot_guard is not None:
            await self.slot_guard.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    def _engine_died(self, error: Exception) -> None:
        """From the engine's thread (its reader thread with --engine-process): the engine can run no
        more (a tensor-parallel rank died, or the engine-core process did). The worker is failed from then on:
        its registry entry says so at once (the gateway stops routing to it) and /readyz is 503."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._fail_serving, str(error))

    def _fail_serving(self, reason: str) -> None:
        log.error("the engine stopped; the worker is failed: %s", reason)
        self.engine_failure = reason
        self.state = State.FAILED
        self.exit_code = 1
        self._changed()

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _changed(self) -> None:
        if self.registration is not None:
            self.registration.poke()

    # ---- requests ------------------------------------------------------------------------

    def require_ready(self) -> tuple[EngineClient, AdapterSet]:
        """The engine and the adapters, or the 503 that says why there are none."""
        if self._serves() and self.engine is not None and self.adapters is not None:
            return self.engine, self.adapters
        raise self._not_ready()

    def _serves(self) -> bool:
        """Ready, or still loading and this request is the HTTP warm-up's own (http_warmup.WARMING)."""
        return self.state is State.READY or (self.state is State.LOADING and WARMING.get())

    def _not_ready(self) -> APIError:
        if self.state is State.DRAINING:
            return APIError(503, "The worker is shutting down; send the request to another worker.", code="draining")
        if self.state is State.FAILED and self.engine_failure is not None:
            return APIError(503, f"The worker's engine stopped ({self.engine_failure}); send the request to another "
                            "worker.", code="failed")  # fmt: skip
        if self.state is State.FAILED:
            return APIError(503, "The worker failed to start; see its log.", code="failed")
        return APIError(503, "The model is still loading; retry shortly.", code="loading")

    def admit(self, request_id: str, tenant: str | None = None) -> None:
        """Count a request of `tenant` (its cache salt; None: the operator's) in, or refuse it: 503
        when the worker stopped being ready since the request began (a drain) or the room is full,
        429 when the tenant holds its share of the room's last places (serving.engine.server.waiting_room)."""
        if not self._serves():
            raise self._not_ready()
        refusal = self._inflight.refusal(tenant)
        if refusal == "full":
            raise overloaded(
                f"The worker is at capacity: {len(self._inflight)} requests in flight "
                f"(max_num_seqs {self.args.max_num_seqs} + max_queued_requests {self.args.max_queued_requests}). "
                "Retry later or on another worker."
            )
        if refusal is not None and tenant is not None:
            # A 4xx: the tenant's own load, which counts against no worker and no adapter.
            raise APIError(429, f"This tenant holds {self._inflight.held(tenant)} of the worker's "
                                f"{self.capacity} places for requests, its share while the room is nearly full; "
                                "retry when some of its requests finish.", code="tenant_share_exceeded")
        self._inflight.enter(request_id, tenant)

    def release(self, request_id: str) -> None:
        self._inflight.leave(request_id)

    def abort_soon(self, request_id: str) -> None:
        """Abort without awaiting: usable where the caller is being cancelled (a disconnect)."""
        if self.engine is not None:
            self._spawn(self._abort(request_id), f"abort-{request_id}")

    async def _abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)  # type: ignore[union-attr]
        except EngineDeadError:
            pass

    # ---- state for /health, /metrics and Redis --------------------------------------------

    async def stats(self) -> EngineStats | None:
        if self.engine is None or not self.engine.is_running:
            return None
        return await self.engine.get_stats()

    def gpu_memory_free_bytes(self) -> int | None:
        """Free memory of the engine's CUDA device as the driver reports it (other processes' use
        included), read here when the engine gives no stats (it failed); None on CPU, before the
        engine picked its device, and with --engine-process (this process opens no CUDA context)."""
        if self.engine is None or self.config.torch_device.type != "cuda" or self.engine_process:
            return None
        free, _ = torch.cuda.mem_get_info(self.config.torch_device)
        return int(free)

    async def describe(self) -> dict[str, Any]:
        """This worker's entry in Redis (the gateway routes by it; docs/serving-worker.md)."""
        stats = await self.stats() if self.state is not State.FAILED else None
        document: dict[str, Any] = {
            "url": self.args.public_url,
            "state": self.state.value,
            "base_model": self.base_model_id,
            "base_model_revision": self.args.model_revision,
            "served_model_names": self.base_model_ids,
            "max_loras": stats.max_loras if stats is not None else self.args.max_loras or 0,
            # One worker however many devices its engine spans (its ranks never register).
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "max_cpu_loras": self.config.max_cpu_loras,
            "max_lora_rank": self.args.max_lora_rank,
            "max_num_seqs": self.args.max_num_seqs,
            # The waiting room past which admit() answers 503; the gateway sheds below vip at a
            # share of it (serving.gateway.shedding).
            "max_queued_requests": self.args.max_queued_requests,
            "gpu_memory_free_bytes": (stats.gpu_memory_free_bytes if stats is not None
                                      else self.gpu_memory_free_bytes()),
            "max_model_len": self.engine.max_model_len if self.engine is not None else None,
            "started_at": self.started_at,
            "api_key_id": api_key_id(self.args.api_key),
            "requests_in_flight": len(self._inflight),
            "queue_depth": 0,
            "running": 0,
            "kv_cache_usage": 0.0,
            "adapters": [],
        }
        if stats is not None:
            document.update(
                queue_depth=stats.num_waiting,
                running=stats.num_running,
                kv_cache_usage=stats.kv_usage,
                adapters=[
                    {
                        "name": info.name,
                        "digest": info.digest,
                        "gpu": info.gpu_slot is not None,
                        "cpu": info.in_cpu_cache,
                    }
                    for info in stats.adapters
                ],
            )
        return document
