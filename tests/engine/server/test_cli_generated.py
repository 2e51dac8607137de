"""The worker's command line is generated from ServerArgs (serving/engine/server/cli.py): each
field marked Flag is the flag of its name, with the field's default and description; the engine's
defaults are EngineConfig's and GrammarBudget's, written once; bounds are the fields' own."""

from __future__ import annotations

import dataclasses

import pytest

from serving.engine.config import EngineConfig
from serving.engine.grammar_pool import GrammarBudget
from serving.engine.server.cli import ServerArgs, build_parser, env_variables
from serving.gateway.config import GatewayConfig
from runtime.settings import platform_settings

# The flags operators' command lines and `make up` use: the generated parser must keep every one.
FLAGS = """--model --host --port --served-model-name --api-key --max-loras --max-cpu-loras --max-lora-rank
--lora-memory-bytes --lora-memory-fraction --cpu-lora-cache-bytes --lora-prefetch-groups --lora-modules --allowed-adapter-path
--max-num-seqs --max-num-batched-tokens --max-model-len --block-size --num-gpu-blocks-override
--gpu-memory-utilization --dtype --device --load-format --seed --enforce-eager --tensor-parallel-size -tp
--enable-prefix-caching --no-enable-prefix-caching --enable-dora --no-enable-dora --borrow-kv-memory --async-scheduling --no-async-scheduling --quantization
--decode-stall-target --decode-stall-max-wait-steps
--engine-process --no-engine-process --warmup --no-warmup --grammar-compile-timeout --grammar-compile-workers
--grammar-tenant-share
--max-grammar-schema-depth --max-queued-requests --timeout-graceful-shutdown --header-timeout --body-timeout
--max-connections-per-client --max-request-body-bytes --trust-request-chat-template --chat-template-timeout
--tool-call-parser --slot-verify-interval --switch-interval --uvicorn-log-level --registry-url --registry-token
--registry-reconcile-interval --redis-url --worker-id --advertise-url --heartbeat-interval -h --help""".split()


def test_every_flag_is_kept_and_each_is_a_field_with_its_default_and_help() -> None:
    parser = build_parser()
    assert sorted(option for action in parser._actions for option in action.option_strings) == sorted(FLAGS)
    fields = {field.name: field for field in dataclasses.fields(ServerArgs)}
    described = ServerArgs.__pydantic_fields__  # type: ignore[attr-defined]
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.dest in fields
        if described[action.dest].description:
            assert action.help == described[action.dest].description.replace("%", "%%")
    assert parser.get_default("max_queued_requests") == 1024


def test_the_engine_defaults_are_the_engine_configs_written_once() -> None:
    args = build_parser().parse_args(["--model", "unused"])
    engine = {field.name: field.default for field in dataclasses.fields(EngineConfig)}
    assert args.max_lora_rank == platform_settings().max_lora_rank, "MAX_LORA_RANK's default, the registry's bound"
    for name in ("max_loras", "max_cpu_loras", "lora_memory_fraction", "max_num_seqs",
                 "max_num_batched_tokens", "block_size", "gpu_memory_utilization", "dtype", "device", "load_format",
                 "seed", "enforce_eager", "tensor_parallel_size", "enable_prefix_caching", "quantization",
                 "borrow_kv_memory", "decode_stall_target", "decode_stall_max_wait_steps", "lora_prefetch_groups"):
        assert getattr(args, name) == engine[name], name
    grammar = GrammarBudget()
    assert (args.grammar_compile_timeout, args.grammar_compile_workers, args.max_grammar_schema_depth) == \
        (grammar.timeout, grammar.workers, grammar.max_schema_depth)
    assert args.max_request_body_bytes == GatewayConfig().max_body_bytes, "the gateway's bound is the worker's"


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-queued-requests", "-1"], "argument --max-queued-requests: must be >= 0, got -1"),
    (["--block-size", "0"], "argument --block-size: must be > 0, got 0"),
    (["--switch-interval", "0"], "argument --switch-interval: must be > 0, got 0"),
    (["-tp", "0"], "argument --tensor-parallel-size/-tp: must be > 0, got 0"),
    (["--lora-modules", "nopath"], "--lora-modules takes name=path, got 'nopath'"),
    (["--load-format", "pickle"], "argument --load-format: invalid choice: 'pickle'"),
])
def test_a_bad_value_is_refused_naming_its_flag(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "unused", *argv])
    assert message in capsys.readouterr().err


def test_every_flag_but_where_the_worker_is_takes_its_default_from_a_serving_worker_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 39, items 1 and 5: `make up`, compose and a worker by hand read the same settings.
    variables = env_variables()
    assert variables["SERVING_WORKER_LORA_MEMORY_BYTES"] == "--lora-memory-bytes"
    assert "SERVING_WORKER_MODEL" not in variables and "SERVING_WORKER_PORT" not in variables
    for name, value in {"SERVING_WORKER_LORA_MEMORY_BYTES": "268435456", "SERVING_WORKER_TOOL_CALL_PARSER": "hermes",
                        "SERVING_WORKER_ENFORCE_EAGER": "true", "SERVING_WORKER_ENABLE_PREFIX_CACHING": "false",
                        "SERVING_WORKER_ALLOWED_ADAPTER_PATH": "/srv/a, /srv/b", "MAX_LORA_RANK": "32"}.items():
        monkeypatch.setenv(name, value)
    platform_settings.cache_clear()
    try:
        args = build_parser().parse_args(["--model", "unused", "--tool-call-parser", "mistral"])
    finally:
        platform_settings.cache_clear()
    assert (args.lora_memory_bytes, args.enforce_eager, args.enable_prefix_caching) == (268435456, True, False)
    assert args.allowed_adapter_path == ["/srv/a", "/srv/b"]
    assert args.max_lora_rank == 32, "MAX_LORA_RANK, the rank the registry accepts, is the worker's default"
    assert args.tool_call_parser == "mistral", "the command line wins over the variable"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("SERVING_WORKER_LORA_MEMORY_BYTES", "0", "SERVING_WORKER_LORA_MEMORY_BYTES='0' (environment or .env, for "
     "--lora-memory-bytes): must be > 0, got 0"),
    ("SERVING_WORKER_TOOL_CALL_PARSER", "xml", "SERVING_WORKER_TOOL_CALL_PARSER='xml' (environment or .env, for "
     "--tool-call-parser): must be one of"),
    ("SERVING_WORKER_ENFORCE_EAGER", "maybe", "must be true or false"),
    ("SERVING_WORKER_MAX_NUM_SEQS", "many", "SERVING_WORKER_MAX_NUM_SEQS='many'"),
])
def test_a_bad_variable_is_refused_naming_it(name: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(name, value)
    platform_settings.cache_clear()
    try:
        with pytest.raises(SystemExit):
            build_parser()
    finally:
        platform_settings.cache_clear()
    assert message in capsys.readouterr().err
