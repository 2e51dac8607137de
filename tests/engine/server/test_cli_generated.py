"""The worker's command line is generated from ServerArgs (serving/engine/server/cli.py): each
field marked Flag is the flag of its name, with the field's default and description; the engine's
defaults are EngineConfig's and GrammarBudget's, written once; bounds are the fields' own."""

from __future__ import annotations

import dataclasses

import pytest

from serving.engine.config import EngineConfig
from serving.engine.grammar_pool import GrammarBudget
from serving.engine.server.cli import ServerArgs, build_parser
from serving.gateway.config import GatewayConfig

# The flags operators' command lines and `make up` use: the generated parser must keep every one.
FLAGS = """--model --host --port --served-model-name --api-key --max-loras --max-cpu-loras --max-lora-rank
--lora-memory-bytes --lora-memory-fraction --cpu-lora-cache-bytes --lora-modules --allowed-adapter-path
--max-num-seqs --max-num-batched-tokens --max-model-len --block-size --num-gpu-blocks-override
--gpu-memory-utilization --dtype --device --load-format --seed --enforce-eager --tensor-parallel-size -tp
--enable-prefix-caching --no-enable-prefix-caching --async-scheduling --no-async-scheduling --quantization
--engine-process --no-engine-process --grammar-compile-timeout --grammar-compile-workers --grammar-tenant-share
--max-grammar-schema-depth --max-queued-requests --timeout-graceful-shutdown --header-timeout --body-timeout
--max-connections-per-client --max-request-body-bytes --trust-request-chat-template --chat-template-timeout
--tool-call-parser --slot-verify-interval --uvicorn-log-level --registry-url --registry-token
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
    for name in ("max_loras", "max_cpu_loras", "max_lora_rank", "lora_memory_fraction", "max_num_seqs",
                 "max_num_batched_tokens", "block_size", "gpu_memory_utilization", "dtype", "device", "load_format",
                 "seed", "enforce_eager", "tensor_parallel_size", "enable_prefix_caching", "quantization"):
        assert getattr(args, name) == engine[name], name
    grammar = GrammarBudget()
    assert (args.grammar_compile_timeout, args.grammar_compile_workers, args.max_grammar_schema_depth) == \
        (grammar.timeout, grammar.workers, grammar.max_schema_depth)
    assert args.max_request_body_bytes == GatewayConfig().max_body_bytes, "the gateway's bound is the worker's"


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-queued-requests", "-1"], "argument --max-queued-requests: must be >= 0, got -1"),
    (["--block-size", "0"], "argument --block-size: must be > 0, got 0"),
    (["-tp", "0"], "argument --tensor-parallel-size/-tp: must be > 0, got 0"),
    (["--lora-modules", "nopath"], "--lora-modules takes name=path, got 'nopath'"),
    (["--load-format", "pickle"], "argument --load-format: invalid choice: 'pickle'"),
])
def test_a_bad_value_is_refused_naming_its_flag(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "unused", *argv])
    assert message in capsys.readouterr().err
