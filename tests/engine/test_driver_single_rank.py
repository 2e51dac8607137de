"""The tensor-parallel driver at size 1 (`distributed_executor_backend="mp"`): the driver's own paths
(its group, its step messages, its adapter writes queued for ranks) on one device, with the same
greedy tokens as the plain runner for a batch mixing two adapters and the base. On CUDA (gpu mark)
the same runs with its CUDA graphs captured: how the driver's CUDA path is checked on a machine
with one GPU (issue 42, item 4), before any multi-GPU run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from serving.engine import LLM, EngineConfig, LoRARequest, SamplingParams
from serving.engine.distributed.driver import DriverRunner
from serving.engine.model_runner import ModelRunner

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello there, little house", "The lazy dog sleeps"]
ENGINE = dict(max_loras=2, max_lora_rank=8, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              block_size=4, num_kv_blocks=64)

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _generate(model: Path, adapters: dict[str, Path], device: str, backend: str | None) -> tuple[type, list[list[int]]]:
    dtype = "float32" if device == "cpu" else "bfloat16"
    llm = LLM(str(model), device=device, dtype=dtype, distributed_executor_backend=backend, **ENGINE)
    try:
        names = [*adapters, None]
        loras = [None if (name := names[i % len(names)]) is None else LoRARequest(name, str(adapters[name]))
                 for i in range(len(PROMPTS))]  # fmt: skip
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), lora_request=loras)
        runner_type = type(llm.llm_engine.runner)
        if device == "cuda":
            assert llm.llm_engine.config.graph_sizes(), "one rank captures its graphs, through the driver too"
    finally:
        llm.llm_engine.shutdown()
    assert not torch.distributed.is_initialized(), "the driver leaves its group of one: another engine may start"
    return runner_type, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("device", DEVICES)
def test_the_driver_at_size_one_generates_what_the_plain_runner_does(
        device: str, tiny_model_factory: Callable[..., Path], make_adapter: Callable[..., Path]) -> None:
    model = tiny_model_factory("llama")
    adapters = {f"ad{i}": make_adapter(model, r=8, lora_alpha=16, seed=20 + i, init_scale=0.5) for i in range(2)}
    driver, through_driver = _generate(model, adapters, device, "mp")
    plain, direct = _generate(model, adapters, device, None)
    assert issubclass(driver, DriverRunner) and plain is ModelRunner
    assert through_driver == direct


def test_one_process_cannot_serve_several_ranks(tiny_model_factory: Callable[..., Path]) -> None:
    model = str(tiny_model_factory("llama"))
    with pytest.raises(ValueError, match="'uni' runs one process"):
        EngineConfig(model=model, device="cpu", tensor_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="must be None, 'uni' or 'mp'"):
        EngineConfig(model=model, device="cpu", distributed_executor_backend="ray")
