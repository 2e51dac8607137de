"""Command line of the serving worker. Flags carry vLLM's names (`vllm serve` users can copy their
command over); flags vLLM does not have are the worker's own (registry sync, self-registration,
admission bound, shutdown grace period, adapter roots, request body bound).

    python -m serving.engine.server --model PATH|ORG/NAME[@REVISION] [--host 127.0.0.1] [--port 8100]
        [--max-loras N] [--max-cpu-loras N] [--max-lora-rank R] [--lora-memory-bytes B] [--lora-modules name=path …]
        [--registry-url URL --registry-token T] [--api-key K]
"""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from serving.engine.server.adapter_roots import AdapterRoots, platform_storage_url
from serving.engine.server.tool_parsers import PARSER_CHOICES
from serving.wire.hub import ModelSourceError, resolve_model
from serving.wire.settings import platform_settings


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str


@dataclass
class ServerArgs:
    model: str  # the local directory (a Hugging Face id's snapshot in the hub cache)
    # The base's commit when --model names a Hugging Face id or a cache snapshot (serving.wire.hub);
    # None for a plain directory. Registry versions built on another commit are refused.
    model_revision: str | None = None
    host: str = "127.0.0.1"
    port: int = 8100
    served_model_name: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_memory_bytes: int | None = None
    lora_memory_fraction: float = 0.2
    cpu_lora_cache_bytes: int | None = None
    lora_modules: list[LoRAModule] = field(default_factory=list)
    allowed_adapter_path: list[str] = field(default_factory=list)
    trust_request_chat_template: bool = False
    tool_call_parser: str = "auto"
    chat_template_timeout: float = 5.0
    max_request_body_bytes: int = 1024 * 1024
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "safetensors"
    seed: int = 0
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    async_scheduling: bool | None = None  # None: on for one CUDA device (engine_config decides)
    quantization: str | None = None
    grammar_compile_timeout: float = 5.0
    grammar_compile_workers: int = 2
    grammar_tenant_share: int | None = None
    max_grammar_schema_depth: int = 64
    engine_process: bool | None = None  # None: on for one CUDA device (worker.uses_engine_process decides)
    max_queued_requests: int = 1024
    timeout_graceful_shutdown: float = 30.0
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    max_connections_per_client: int = 0
    slot_verify_interval: float = 60.0
    registry_url: str | None = None
    registry_token: str | None = None
    registry_reconcile_interval: float = 30.0
    redis_url: str | None = None
    worker_id: str | None = None
    advertise_url: str | None = None
    heartbeat_interval: float = 5.0
    uvicorn_log_level: str = "info"

    @property
    def public_url(self) -> str:
        if self.advertise_url:
            return self.advertise_url.rstrip("/")
        host = self.host if self.host not in ("0.0.0.0", "::", "") else socket.getfqdn()
        return f"http://{host}:{self.port}"

    @property
    def resolved_worker_id(self) -> str:
        return self.worker_id or f"{socket.gethostname()}:{self.port}"


def adapter_roots(allowed_adapter_path: Sequence[str]) -> AdapterRoots:
    """Where adapters may be loaded from: the platform's storage and the operator's extra roots."""
    return AdapterRoots([platform_storage_url(), *allowed_adapter_path])


def _lora_module(text: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form `{"name": …, "path": …}`."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return LoRAModule(name=str(spec["name"]), path=str(spec["path"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"--lora-modules JSON needs 'name' and 'path': {text!r}") from exc
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {text!r}")
    return LoRAModule(name=name, path=path)


N = TypeVar("N", int, float)


def _positive(kind: Callable[[str], N]) -> Callable[[str], N]:
    def parse(text: str) -> N:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    settings = platform_settings()  # the defaults below that are settings: environment, then .env
    p = argparse.ArgumentParser(
        prog="python -m serving.engine.server",
        description="Loraplex serving worker: one base model, many LoRA adapters, an OpenAI-compatible API.",
    )
    p.add_argument(
        "--model", required=True,
        help="a local Hugging Face model directory, or a Hugging Face id org/name[@revision] found in the hub cache "
        "(HF_HOME) or else downloaded (HF_TOKEN for gated models; HF_HUB_OFFLINE=1: the cache only)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument(
        "--served-model-name", nargs="+", default=[], help="the base model's id(s) in the API (default: --model)"
    )
    p.add_argument(
        "--api-key",
        default=settings.serving_worker_api_key or None,
        help="the operator's key, required as `Authorization: Bearer KEY` on /v1/* "
        "(default: $SERVING_WORKER_API_KEY, from the environment or .env; unset: open, and no caller is the operator)",
    )
    lora = p.add_argument_group("LoRA")
    lora.add_argument(
        "--max-loras", type=int, default=None,
        help="at most this many adapters resident on the GPU at once (default: as many as the adapter memory "
        "holds); alone, it also sizes that memory to this many adapters of --max-lora-rank; 0 turns LoRA off",
    )
    lora.add_argument("--max-cpu-loras", type=int, default=None, help="at most this many adapters in the CPU cache")
    lora.add_argument("--max-lora-rank", type=int, default=16)
    lora.add_argument(
        "--lora-memory-bytes", type=_positive(int), default=None,
        help="GPU bytes for adapters (default: what the KV cache leaves, at least --lora-memory-fraction)",
    )
    lora.add_argument(
        "--lora-memory-fraction", type=float, default=0.2,
        help="share of the memory budget adapters get at least, by default (docs/adapter-memory.md)",
    )
    lora.add_argument(
        "--cpu-lora-cache-bytes", type=_positive(int), default=None,
        help="host bytes for the CPU adapter cache (default: twice the GPU adapter memory, at most 1/4 of RAM)",
    )
    lora.add_argument(
        "--lora-modules", nargs="+", type=_lora_module, default=[], metavar="NAME=PATH", help="adapters to load at start"
    )
    lora.add_argument(
        "--allowed-adapter-path",
        action="append",
        default=[],
        metavar="ROOT",
        help="a directory, file:///path or s3://bucket[/prefix] adapters may be loaded from, besides the "
        "platform's storage ($STORAGE_URL); repeatable. --lora-modules are not restricted",
    )
    engine = p.add_argument_group("engine")
    engine.add_argument("--max-num-seqs", type=_positive(int), default=256)
    engine.add_argument("--max-num-batched-tokens", type=_positive(int), default=2048)
    engine.add_argument("--max-model-len", type=_positive(int), default=None)
    engine.add_argument("--block-size", type=_positive(int), default=16)
    engine.add_argument(
        "--num-gpu-blocks-override", type=_positive(int), default=None, help="KV-cache blocks (CPU too)"
    )
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--device", default="auto")
    engine.add_argument(
        "--load-format",
        choices=["safetensors", "dummy"],
        default="safetensors",
        help="dummy: random base weights of the model's shape (benchmarks without the weights)",
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--enforce-eager", action="store_true", help="never replay CUDA graphs (vLLM's flag; graphs are CUDA-only)"
    )
    engine.add_argument(
        "--tensor-parallel-size", "-tp", type=_positive(int), default=1,
        help="shard the model over this many processes, one per GPU (vLLM's flag; on CPU all on the host)",
    )  # fmt: skip
    engine.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV of a prompt's leading blocks computed before for the same adapter version (or the "
        "base) instead of prefilling them again (vLLM's flag; on by default, as vLLM V1)",
    )  # fmt: skip
    engine.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="schedule and launch each step while the one before still runs on the GPU (vLLM's flag; by "
        "default on for one CUDA device, off on CPU and with --tensor-parallel-size > 1, which refuses it)",
    )  # fmt: skip
    engine.add_argument(
        "--quantization", choices=["fp8"], default=None,
        help="fp8: the base model's projections in FP8 e4m3 with per-channel scales (half the weight bytes; "
        "bf16 on CUDA, native on Hopper); adapters stay in --dtype. Tokens agree with bf16's to a measured rate, "
        "not exactly (vLLM's flag)",
    )  # fmt: skip
    engine.add_argument(
        "--engine-process", action=argparse.BooleanOptionalAction, default=None,
        help="run the engine core (scheduler, model, adapters) in a child process of its own, so its steps never "
        "wait for the interpreter lock the HTTP loop holds (as vLLM V1 does); by default on for one CUDA device "
        "(on the H200 +46 %% output tok/s at capacity), off on CPU and with --tensor-parallel-size > 1 "
        "(docs/serving-worker.md)",
    )  # fmt: skip
    grammar = p.add_argument_group("structured output (docs/security.md, \"Grammar compilation\")")
    grammar.add_argument(
        "--grammar-compile-timeout", type=_positive(float), default=5.0,
        help="seconds one constraint (response_format, guided_*, tools) may take to compile; past it its compiling "
        "process is killed and the request refused with 400 grammar_too_complex",
    )  # fmt: skip
    grammar.add_argument(
        "--grammar-compile-workers", type=_positive(int), default=2,
        help="processes compiling constraints; their queue is served round-robin between tenants",
    )  # fmt: skip
    grammar.add_argument(
        "--grammar-tenant-share", type=_positive(int), default=None,
        help="compiles one tenant may run at once (default: one fewer than --grammar-compile-workers, at least 1, "
        "so another tenant's compile starts at once)",
    )  # fmt: skip
    grammar.add_argument(
        "--max-grammar-schema-depth", type=_positive(int), default=64,
        help="deepest JSON nesting of a schema compiled (a schema level under properties is two); deeper: 400",
    )  # fmt: skip
    server = p.add_argument_group("server")
    server.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests beyond --max-num-seqs that may wait; past that, 503 (0: no waiting at all)",
    )
    server.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    server.add_argument(
        "--header-timeout",
        type=_positive(float),
        default=10.0,
        help="seconds a request may take to send its headers (from its first byte, or from the connection's "
        "opening); past it 408 and the connection is closed. Idle connections are kept 75 s between requests",
    )
    server.add_argument(
        "--body-timeout",
        type=float,
        default=60.0,
        help="seconds a request body may go without a byte once its headers are in; past it 408 and the "
        "connection is closed (0: no limit)",
    )
    server.add_argument(
        "--max-connections-per-client",
        type=int,
        default=0,
        help="connections one client address may hold at once; more are refused with 503 (0: no cap; the "
        "gateway keeps up to 1000 per web process)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=_positive(int),
        default=1024 * 1024,
        help="larger request bodies are refused with 413 before they are read",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a caller's own chat template (chat_template, chat_template_kwargs.chat_template); "
        "it is rendered in Jinja's sandbox in a child process with time and memory limits. Off: 400",
    )
    server.add_argument(
        "--chat-template-timeout",
        type=_positive(float),
        default=5.0,
        help="seconds a caller's chat template may take to render (with --trust-request-chat-template)",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=PARSER_CHOICES,
        default="auto",
        help="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>), llama3_json, mistral "
        "([TOOL_CALLS][…]); auto: the one whose marker the chat template writes; none: requests with tools "
        "must send tool_choice none",
    )
    server.add_argument(
        "--slot-verify-interval",
        type=float,
        default=60.0,
        help="seconds between checks of every GPU slot's checksum (a changed slot is reloaded from storage); 0: "
        "only on request (POST /v1/verify_lora_slots)",
    )
    server.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    registry = p.add_argument_group("registry sync and self-registration")
    registry.add_argument("--registry-url", default=None, help="the registry's internal snapshot endpoint")
    registry.add_argument("--registry-token", default=settings.registry_token or None,
                          help="default: $REGISTRY_TOKEN (environment or .env)")
    registry.add_argument("--registry-reconcile-interval", type=_positive(float), default=30.0)
    registry.add_argument(
        "--redis-url",
        default=settings.redis_url,
        help="deploy events and worker registration (default: $REDIS_URL, environment or .env; unset: neither)",
    )
    registry.add_argument("--worker-id", default=None, help="default: HOSTNAME:PORT")
    registry.add_argument("--advertise-url", default=None, help="URL the gateway reaches this worker at")
    registry.add_argument("--heartbeat-interval", type=_positive(float), default=5.0)
    return p


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.registry_url and not ns.registry_token:
        parser.error("--registry-url needs --registry-token (or $REGISTRY_TOKEN)")
    if ns.max_queued_requests < 0:
        parser.error(f"--max-queued-requests must be >= 0, got {ns.max_queued_requests}")
    if ns.slot_verify_interval < 0:
        parser.error(f"--slot-verify-interval must be >= 0, got {ns.slot_verify_interval}")
    if ns.body_timeout < 0:
        parser.error(f"--body-timeout must be >= 0, got {ns.body_timeout}")
    if ns.max_connections_per_client < 0:
        parser.error(f"--max-connections-per-client must be >= 0, got {ns.max_connections_per_client}")
    if ns.timeout_graceful_shutdown < 0:
        parser.error(f"--timeout-graceful-shutdown must be >= 0, got {ns.timeout_graceful_shutdown}")
    try:
        adapter_roots(ns.allowed_adapter_path)
    except ValueError as exc:
        parser.error(f"--allowed-adapter-path: {exc}")
    try:
        resolved = resolve_model(ns.model)
    except ModelSourceError as exc:
        parser.error(f"--model: {exc}")
    if resolved.repo_id is not None and ns.model != str(resolved.path):
        # Named by id: the API calls the base by its id (without the revision) unless told otherwise.
        ns.served_model_name = ns.served_model_name or [resolved.repo_id]
        ns.model = str(resolved.path)
    ns.model_revision = resolved.revision
    names = [m.name for m in ns.lora_modules]
    if len(set(names)) != len(names):
        parser.error(f"--lora-modules names must be unique, got {names}")
    return ServerArgs(**vars(ns))
