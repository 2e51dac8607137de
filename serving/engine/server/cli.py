"""Command line of the serving worker. Flags carry vLLM's names (`vllm serve` users can copy their
command over); flags vLLM does not have are the worker's own (registry sync, self-registration,
admission bound, shutdown grace period, adapter roots, request body bound).

    python -m serving.engine.server --model PATH|ORG/NAME[@REVISION] [--host 127.0.0.1] [--port 8100]
        [--max-loras N] [--max-cpu-loras N] [--max-lora-rank R] [--lora-memory-bytes B] [--lora-modules name=path …]
        [--registry-url URL --registry-token T] [--api-key K]

The flags are generated from `ServerArgs`, a pydantic dataclass of the worker's settings: each field
marked `Flag` is the flag of its name (`max_lora_rank` is --max-lora-rank), its description the
help, its default the flag's (the engine's own defaults are EngineConfig's and GrammarBudget's,
written there once), a `gt=0`/`ge=0` bound the flag's check. Four defaults are platform settings, read
through runtime.settings (environment, then .env): --api-key, --registry-token, --redis-url and
--max-lora-rank (MAX_LORA_RANK: the rank the registry accepts is the rank the worker loads).

Every flag but those naming where the worker is and what it serves (`NOT_FROM_ENV`, which `make up`
and docker-compose.yml set from BASE_MODEL, LORAPLEX_SERVING_PORT, …) also takes its default from
the variable SERVING_WORKER_ + its name in capitals (--lora-memory-bytes: SERVING_WORKER_LORA_MEMORY_BYTES),
in the environment or `.env`, so an operator sets any worker setting in the one settings file that
`make up`, compose and a worker started by hand all read (issue 39, items 1 and 5). The order, first
wins: the command line, that variable, the platform setting, the field's default. A value that does
not parse stops the worker with a message naming the variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, Union, cast, get_args, get_origin

import annotated_types
from pydantic import Field
from pydantic.fields import FieldInfo
from pydantic.dataclasses import dataclass as settings_dataclass

from serving.engine.config import EngineConfig
from serving.engine.grammar_pool import GrammarBudget
from serving.engine.server.adapter_roots import AdapterRoots, platform_storage_url
from serving.engine.server.tool_parsers import PARSER_CHOICES
from runtime.hub import ModelSourceError, resolve_model
from runtime.settings import MAX_REQUEST_BODY_BYTES, PlatformSettings, platform_settings

_ENGINE: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_GRAMMAR = GrammarBudget()
LORA, ENGINE, GRAMMAR = "LoRA", "engine", "structured output (docs/security.md, \"Grammar compilation\")"
SERVER, REGISTRY = "server", "registry sync and self-registration"


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str


@dataclass(frozen=True)
class Flag:
    """Marks a ServerArgs field as a command-line flag, with what argparse needs beyond its type."""

    group: str | None = None  # None: the parser's own options
    short: str | None = None
    choices: Sequence[str] | None = None
    metavar: str | None = None
    repeat: bool = False  # a list given by repeating the flag, not by several values after it
    negatable: bool = False  # --x / --no-x, for a bool default True or None
    parse: Callable[[str], Any] | None = None  # one value's parser, for a type argparse does not know
    from_settings: Callable[[PlatformSettings], Any] | None = None  # the default, from the settings


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


@settings_dataclass
class ServerArgs:
    # The local directory (a Hugging Face id's snapshot in the hub cache).
    model: Annotated[str, Flag()] = Field(description=(
        "a local Hugging Face model directory, or a Hugging Face id org/name[@revision] found in the hub cache "
        "(HF_HOME) or else downloaded (HF_TOKEN for gated models; HF_HUB_OFFLINE=1: the cache only)"))
    # The base's commit when --model names a Hugging Face id or a cache snapshot (runtime.hub);
    # None for a plain directory. Registry versions built on another commit are refused.
    model_revision: str | None = None
    host: Annotated[str, Flag()] = "127.0.0.1"
    port: Annotated[int, Flag()] = 8100
    served_model_name: Annotated[list[str], Flag()] = Field(
        default_factory=list, description="the base model's id(s) in the API (default: --model)")
    api_key: Annotated[str | None, Flag(from_settings=lambda s: s.serving_worker_api_key or None)] = Field(
        default=None, description="the operator's key, required as `Authorization: Bearer KEY` on /v1/* (default: "
        "$SERVING_WORKER_API_KEY, from the environment or .env; unset: open, and no caller is the operator)")
    # --- LoRA
    max_loras: Annotated[int | None, Flag(LORA)] = Field(default=_ENGINE["max_loras"], description=(
        "at most this many adapters resident on the GPU at once (default: as many as the adapter memory "
        "holds); alone, it also sizes that memory to this many adapters of --max-lora-rank; 0 turns LoRA off"))
    max_cpu_loras: Annotated[int | None, Flag(LORA)] = Field(
        default=_ENGINE["max_cpu_loras"], description="at most this many adapters in the CPU cache")
    max_lora_rank: Annotated[int, Flag(LORA, from_settings=lambda s: s.max_lora_rank)] = Field(
        default=_ENGINE["max_lora_rank"], gt=0, description=(
        "the largest adapter rank served (default: $MAX_LORA_RANK, the largest the registry accepts)"))
    lora_memory_bytes: Annotated[int | None, Flag(LORA)] = Field(
        default=_ENGINE["lora_memory_bytes"], gt=0, description=(
        "GPU bytes for adapters (default: what the KV cache leaves, at least --lora-memory-fraction)"))
    lora_memory_fraction: Annotated[float, Flag(LORA)] = Field(default=_ENGINE["lora_memory_fraction"], description=(
        "share of the memory budget adapters get at least, by default (docs/adapter-memory.md)"))
    cpu_lora_cache_bytes: Annotated[int | None, Flag(LORA)] = Field(
        default=_ENGINE["cpu_lora_cache_bytes"], gt=0, description=(
        "host bytes for the CPU adapter cache (default: twice the GPU adapter memory, at most 1/4 of RAM)"))
    lora_prefetch_groups: Annotated[int, Flag(LORA)] = Field(
        default=_ENGINE["lora_prefetch_groups"], ge=0, description=(
        "each step, start copying into the GPU (or reading from storage) the adapters of the next this many "
        "waiting adapter groups that are not resident, evicting only idle adapters; 0: off "
        "(docs/adapter-memory.md, \"Admission\")"))
    lora_modules: Annotated[list[LoRAModule], Flag(LORA, metavar="NAME=PATH", parse=_lora_module)] = Field(
        default_factory=list, description="adapters to load at start")
    allowed_adapter_path: Annotated[list[str], Flag(LORA, metavar="ROOT", repeat=True)] = Field(
        default_factory=list, description="a directory, file:///path or s3://bucket[/prefix] adapters may be "
        "loaded from, besides the platform's storage ($STORAGE_URL); repeatable. --lora-modules are not restricted")
    # --- engine
    max_num_seqs: Annotated[int, Flag(ENGINE)] = Field(default=_ENGINE["max_num_seqs"], gt=0)
    max_num_batched_tokens: Annotated[int, Flag(ENGINE)] = Field(default=_ENGINE["max_num_batched_tokens"], gt=0)
    max_model_len: Annotated[int | None, Flag(ENGINE)] = Field(default=_ENGINE["max_model_len"], gt=0)
    block_size: Annotated[int, Flag(ENGINE)] = Field(default=_ENGINE["block_size"], gt=0)
    num_gpu_blocks_override: Annotated[int | None, Flag(ENGINE)] = Field(
        default=_ENGINE["num_kv_blocks"], gt=0, description="KV-cache blocks (CPU too)")
    gpu_memory_utilization: Annotated[float, Flag(ENGINE)] = _ENGINE["gpu_memory_utilization"]
    dtype: Annotated[str, Flag(ENGINE)] = _ENGINE["dtype"]
    device: Annotated[str, Flag(ENGINE)] = _ENGINE["device"]
    load_format: Annotated[str, Flag(ENGINE, choices=("safetensors", "dummy"))] = Field(
        default=_ENGINE["load_format"], description=(
        "dummy: random base weights of the model's shape (benchmarks without the weights)"))
    seed: Annotated[int, Flag(ENGINE)] = _ENGINE["seed"]
    enforce_eager: Annotated[bool, Flag(ENGINE)] = Field(default=_ENGINE["enforce_eager"], description=(
        "never replay CUDA graphs (vLLM's flag; graphs are CUDA-only)"))
    tensor_parallel_size: Annotated[int, Flag(ENGINE, short="-tp")] = Field(
        default=_ENGINE["tensor_parallel_size"], gt=0, description=(
            "shard the model over this many processes, one per GPU (vLLM's flag; on CPU all on the host)"))
    enable_prefix_caching: Annotated[bool, Flag(ENGINE, negatable=True)] = Field(
        default=_ENGINE["enable_prefix_caching"], description=(
            "reuse the KV of a prompt's leading blocks computed before for the same adapter version (or the "
            "base) instead of prefilling them again (vLLM's flag; on by default, as vLLM V1)"))
    enable_dora: Annotated[bool, Flag(ENGINE, negatable=True)] = Field(
        default=_ENGINE["enable_dora"], description=(
            "serve DoRA adapters: every LoRA layer holds a per-slot scale table, charged to the adapter memory "
            "(2.75 MB a slot on Llama-3-8B); off, DoRA adapters are refused at load (docs/adapter-kinds.md)"))
    borrow_kv_memory: Annotated[bool, Flag(ENGINE)] = Field(default=_ENGINE["borrow_kv_memory"], description=(
        "put the adapter row pool inside the KV cache and move the boundary at run time: adapters waiting "
        "for rows borrow idle KV blocks, KV pressure takes them back (off by default; not with "
        "--tensor-parallel-size > 1; docs/adapter-memory.md)"))
    decode_stall_target: Annotated[float | None, Flag(ENGINE)] = Field(
        default=_ENGINE["decode_stall_target"], description=(
        "the adaptive token budget: a step that carries decodes takes at most as many prompt tokens as keep it "
        "within this many times a decode-only step's time, by step times measured as it runs (2.0: prompts "
        "streaming in at most double the time per output token); --max-num-batched-tokens stays the ceiling. "
        "Unset: off, every step may take the full budget (docs/serving-worker.md, \"The token budget\")"))
    decode_stall_max_wait_steps: Annotated[int, Flag(ENGINE)] = Field(
        default=_ENGINE["decode_stall_max_wait_steps"], gt=0, description=(
        "with --decode-stall-target: once the oldest prompt without its first token has waited this many "
        "steps, the step takes the full budget, so prompts never queue without bound behind short steps"))
    # None: on for one CUDA device (engine_config decides).
    async_scheduling: Annotated[bool | None, Flag(ENGINE, negatable=True)] = Field(default=None, description=(
        "schedule and launch each step while the one before still runs on the GPU (vLLM's flag; by "
        "default on for one CUDA device, off on CPU and with --tensor-parallel-size > 1, which refuses it)"))
    quantization: Annotated[str | None, Flag(ENGINE, choices=("fp8", "awq"))] = Field(
        default=_ENGINE["quantization"], description=(
        "fp8: the base model's projections in FP8 e4m3 with per-channel scales (half the weight bytes; "
        "bf16 on CUDA, native on Hopper); adapters stay in --dtype. Tokens agree with bf16's to a measured rate, "
        "not exactly (vLLM's flag). awq: an AWQ INT4 checkpoint, loaded as it is; unset, the checkpoint's "
        "config.json decides (docs/quantized-bases.md)"))
    # None: on for one CUDA device (worker.uses_engine_process decides).
    engine_process: Annotated[bool | None, Flag(ENGINE, negatable=True)] = Field(default=None, description=(
        "run the engine core (scheduler, model, adapters) in a child process of its own, so its steps never "
        "wait for the interpreter lock the HTTP loop holds (as vLLM V1 does); by default on for one CUDA device "
        "(on the H200 +46 % output tok/s at capacity), off on CPU and with --tensor-parallel-size > 1 "
        "(docs/serving-worker.md)"))
    # None: on for CUDA (worker.warms_up decides).
    warmup: Annotated[bool | None, Flag(ENGINE, negatable=True)] = Field(default=None, description=(
        "before saying it is ready, run every step shape the scheduler can produce and every sampler path "
        "once, with the --lora-modules adapters in them (serving.engine.warmup); by default on for CUDA, off "
        "on CPU (docs/serving-worker.md, \"Warm-up: the first minute\")"))
    # --- structured output
    grammar_compile_timeout: Annotated[float, Flag(GRAMMAR)] = Field(default=_GRAMMAR.timeout, gt=0, description=(
        "seconds one constraint (response_format, guided_*, tools) may take to compile; past it its compiling "
        "process is killed and the request refused with 400 grammar_too_complex"))
    grammar_compile_workers: Annotated[int, Flag(GRAMMAR)] = Field(default=_GRAMMAR.workers, gt=0, description=(
        "processes compiling constraints; their queue is served round-robin between tenants"))
    grammar_tenant_share: Annotated[int | None, Flag(GRAMMAR)] = Field(
        default=_GRAMMAR.tenant_share, gt=0, description=(
        "compiles one tenant may run at once (default: one fewer than --grammar-compile-workers, at least 1, "
        "so another tenant's compile starts at once)"))
    max_grammar_schema_depth: Annotated[int, Flag(GRAMMAR)] = Field(
        default=_GRAMMAR.max_schema_depth, gt=0, description=(
        "deepest JSON nesting of a schema compiled (a schema level under properties is two); deeper: 400"))
    # --- server
    max_queued_requests: Annotated[int, Flag(SERVER)] = Field(default=1024, ge=0, description=(
        "requests beyond --max-num-seqs that may wait; past that, 503 (0: no waiting at all)"))
    timeout_graceful_shutdown: Annotated[float, Flag(SERVER)] = Field(default=30.0, ge=0, description=(
        "seconds in-flight requests get to finish after SIGTERM before they are aborted"))
    header_timeout: Annotated[float, Flag(SERVER)] = Field(default=10.0, gt=0, description=(
        "seconds a request may take to send its headers (from its first byte, or from the connection's "
        "opening); past it 408 and the connection is closed. Idle connections are kept 75 s between requests"))
    body_timeout: Annotated[float, Flag(SERVER)] = Field(default=60.0, ge=0, description=(
        "seconds a request body may go without a byte once its headers are in; past it 408 and the "
        "connection is closed (0: no limit)"))
    max_connections_per_client: Annotated[int, Flag(SERVER)] = Field(default=0, ge=0, description=(
        "connections one client address may hold at once; more are refused with 503 (0: no cap; the "
        "gateway keeps up to 1000 per web process)"))
    max_request_body_bytes: Annotated[int, Flag(SERVER)] = Field(default=MAX_REQUEST_BODY_BYTES, gt=0, description=(
        "larger request bodies are refused with 413 before they are read"))
    trust_request_chat_template: Annotated[bool, Flag(SERVER)] = Field(default=False, description=(
        "accept a caller's own chat template (chat_template, chat_template_kwargs.chat_template); "
        "it is rendered in Jinja's sandbox in a child process with time and memory limits. Off: 400"))
    chat_template_timeout: Annotated[float, Flag(SERVER)] = Field(default=5.0, gt=0, description=(
        "seconds a caller's chat template may take to render (with --trust-request-chat-template)"))
    tool_call_parser: Annotated[str, Flag(SERVER, choices=PARSER_CHOICES)] = Field(default="auto", description=(
        "how the model writes tool calls: hermes (<tool_call>{json}</tool_call>), llama3_json, mistral "
        "([TOOL_CALLS][…]), generic (hermes' form, asked for by the worker's own tool prompt); auto: the one "
        "whose marker the chat template writes, else generic; none: requests with tools must send tool_choice "
        "none"))
    slot_verify_interval: Annotated[float, Flag(SERVER)] = Field(default=60.0, ge=0, description=(
        "seconds between checks of every GPU slot's checksum (a changed slot is reloaded from storage); 0: "
        "only on request (POST /v1/verify_lora_slots)"))
    # The engine thread and the HTTP loop share the interpreter lock (serve.py says what was measured).
    switch_interval: Annotated[float, Flag(SERVER)] = Field(default=0.0005, gt=0, description=(
        "seconds a thread holding the interpreter lock runs before one waiting for it gets it "
        "(sys.setswitchinterval; CPython's default is 0.005): how long the engine thread and the HTTP "
        "loop wait for each other when the engine runs on a thread of the worker (docs/serving-worker.md)"))
    uvicorn_log_level: Annotated[str, Flag(SERVER, choices=("critical", "error", "warning", "info", "debug"))] = "info"
    # --- registry sync and self-registration
    registry_url: Annotated[str | None, Flag(REGISTRY)] = Field(
        default=None, description="the registry's internal snapshot endpoint")
    registry_token: Annotated[str | None, Flag(REGISTRY, from_settings=lambda s: s.registry_token or None)] = Field(
        default=None, description="default: $REGISTRY_TOKEN (environment or .env)")
    registry_reconcile_interval: Annotated[float, Flag(REGISTRY)] = Field(default=30.0, gt=0)
    redis_url: Annotated[str | None, Flag(REGISTRY, from_settings=lambda s: s.redis_url)] = Field(
        default=None, description=(
        "deploy events and worker registration (default: $REDIS_URL, environment or .env; unset: neither)"))
    worker_id: Annotated[str | None, Flag(REGISTRY)] = Field(default=None, description="default: HOSTNAME:PORT")
    advertise_url: Annotated[str | None, Flag(REGISTRY)] = Field(
        default=None, description="URL the gateway reaches this worker at")
    heartbeat_interval: Annotated[float, Flag(REGISTRY)] = Field(default=5.0, gt=0)

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


ENV_PREFIX = "SERVING_WORKER_"
# Where the worker is and what it serves: `make up` and compose pass them from the platform's settings.
NOT_FROM_ENV = frozenset({"model", "served_model_name", "host", "port", "registry_url", "advertise_url"})
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})


def env_variables() -> dict[str, str]:
    """{variable: flag} of every flag settable from the environment (SERVING_WORKER_ + its name)."""
    fields: dict[str, FieldInfo] = cast(Any, ServerArgs).__pydantic_fields__
    return {ENV_PREFIX + name.upper(): "--" + name.replace("_", "-") for name, info in fields.items()
            if name not in NOT_FROM_ENV and any(isinstance(item, Flag) for item in info.metadata)}


def _env_default(action: argparse.Action, text: str) -> Any:
    """`text`, a SERVING_WORKER_* variable's value, parsed as the flag `action` parses its argument."""
    if action.nargs == 0:  # store_true and --x/--no-x
        if text.lower() not in _TRUE | _FALSE:
            raise ValueError("must be true or false")
        return text.lower() in _TRUE
    convert = action.type if callable(action.type) else str
    many = action.nargs == "+" or isinstance(action, argparse._AppendAction)
    items = [item.strip() for item in text.split(",") if item.strip()] if many else [text]
    values = []
    for item in items:
        try:
            value = convert(item)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
            raise ValueError(str(error) or f"not a valid {getattr(convert, '__name__', 'value')}") from None
        if action.choices is not None and value not in action.choices:
            raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
        values.append(value)
    return values if many else values[0]


N = TypeVar("N", int, float)


def _bounded(kind: Callable[[str], N], *, strict: bool) -> Callable[[str], N]:
    """`kind`, refused when not > 0 (`strict`) or not >= 0."""
    def parse(text: str) -> N:
        value = kind(text)
        if value < 0 or (strict and value == 0):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} 0, got {text}")
        return value

    return parse


def _flag_options(info: FieldInfo, flag: Flag) -> dict[str, Any]:
    """argparse's keywords for one field: its type (the annotation without None), bound and list form."""
    annotation = info.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    options: dict[str, Any] = {"help": (info.description or "").replace("%", "%%") or None}
    if annotation is bool:
        options["action"] = argparse.BooleanOptionalAction if flag.negatable else "store_true"
        return options
    if get_origin(annotation) is list:
        options["action" if flag.repeat else "nargs"] = "append" if flag.repeat else "+"
        annotation = get_args(annotation)[0]
    kind = flag.parse or annotation
    for bound in info.metadata:
        if isinstance(bound, annotated_types.Gt | annotated_types.Ge) and kind in (int, float):
            kind = _bounded(cast(Callable[[str], Any], kind), strict=isinstance(bound, annotated_types.Gt))
    options["type"] = kind
    options.update({key: value for key, value in (("choices", flag.choices), ("metavar", flag.metavar)) if value})
    return options


def build_parser() -> argparse.ArgumentParser:
    settings = platform_settings()  # the defaults that are settings: environment, then .env
    parser = argparse.ArgumentParser(
        prog="python -m serving.engine.server",
        description="Loraplex serving worker: one base model, many LoRA adapters, an OpenAI-compatible API.",
    )
    groups: dict[str | None, Any] = {None: parser}
    fields: dict[str, FieldInfo] = cast(Any, ServerArgs).__pydantic_fields__  # pydantic's, not in its stubs
    for name, info in fields.items():
        flag = next((item for item in info.metadata if isinstance(item, Flag)), None)
        if flag is None:
            continue
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        options = _flag_options(info, flag)
        if info.is_required():
            options["required"] = True
        else:
            default = info.get_default(call_default_factory=True)
            options["default"] = flag.from_settings(settings) if flag.from_settings else default
        names = ["--" + name.replace("_", "-"), *([flag.short] if flag.short else [])]
        action = groups[flag.group].add_argument(*names, **options)
        variable = ENV_PREFIX + name.upper()
        text = (settings.environ.get(variable) or "").strip() if name not in NOT_FROM_ENV else ""
        if text:
            try:
                action.default = _env_default(action, text)
            except ValueError as error:
                parser.error(f"{variable}={text!r} (environment or .env, for {names[0]}): {error}")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> ServerArgs:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.registry_url and not ns.registry_token:
        parser.error("--registry-url needs --registry-token (or $REGISTRY_TOKEN)")
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
