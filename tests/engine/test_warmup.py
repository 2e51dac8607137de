"""The warm-up (serving.engine.warmup) on the tiny model: it runs every decode batch size up to
max_num_seqs, each prefill chunk length of its ladder with and without an adapter, every sampler
path, and leaves the adapters named at launch in GPU slots; the shapes are those the runner saw."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from serving.engine import EngineConfig, LoRARequest, SamplingParams
from serving.engine.llm_engine import LLMEngine
from serving.engine.model_runner import StepShape
from serving.engine.process_engine import ProcessEngine
from serving.engine.warmup import SAMPLER_PATHS, WarmupReport, prefill_lengths, warm_up, warmup_phases

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_SEQS = 6
BUDGET = 64


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", max_num_seqs=MAX_SEQS,
                                    max_num_batched_tokens=BUDGET, max_model_len=128, block_size=4,
                                    num_kv_blocks=256, max_loras=2))
    for name, seed in (("a", 1), ("b", 2)):
        adapter = make_adapter(tiny_llama_dir, seed=seed, target_modules=("q_proj", "v_proj", "down_proj"))
        load(engine, LoRARequest(name, str(adapter)))
    yield engine
    engine.shutdown()


def load(engine: LLMEngine, adapter: LoRARequest) -> None:
    """Load an adapter into the CPU cache (a load is taken in between steps)."""
    done = engine.add_lora(adapter)
    while not done.done():
        engine.wait_for_loads(0.05)
        engine.step()
    done.result()


def test_prefill_lengths_climb_to_the_budget_and_past_it_into_two_chunks() -> None:
    assert prefill_lengths(2048, 8190) == [16, 32, 64, 128, 256, 512, 1024, 2048, 3072]
    assert prefill_lengths(64, 126) == [16, 32, 64, 96]
    assert prefill_lengths(64, 80) == [16, 32, 64]  # what the context cannot hold is left out


@pytest.fixture(scope="module")
def report(engine: LLMEngine) -> WarmupReport:
    """The engine warmed up (its guided request starts the grammar compiler's processes: e2e)."""
    report = warm_up(engine, ["a", "b"])
    print(report.summary())
    return report


@pytest.mark.e2e
def test_the_warm_up_runs_every_shape_and_path_and_leaves_the_adapters_resident(engine: LLMEngine,
                                                                                 report: WarmupReport) -> None:

    flat = {(s.tokens, s.lora) for s in report.shapes if s.layout == "flat"}
    eager = {(s.tokens, s.lora) for s in report.shapes if s.layout == "eager"}
    # Every decode batch size, the larger ones with adapters mixed in (the ladder shrinks one a step).
    assert {tokens for tokens, _ in flat} >= set(range(1, MAX_SEQS + 1))
    assert {(n, True) for n in range(2, MAX_SEQS + 1)} <= flat
    # Each prefill chunk length, on the base and with an adapter (the CPU's torch attention runs
    # prompt chunks eagerly); 96 tokens is two chunks, the budget's and the rest.
    assert {(n, lora) for n in (16, 32, BUDGET) for lora in (False, True)} <= eager
    assert (96 - BUDGET, False) in eager
    assert report.sampler_paths == set(SAMPLER_PATHS)
    assert report.resident == ("a", "b") and report.not_resident == ()
    ladder, *_, paths = warmup_phases(engine, ["a", "b"])
    assert report.requests == len(ladder) + 2 * len(prefill_lengths(BUDGET, 126)) + len(paths)
    assert not engine.has_unfinished_requests()
    assert engine.runner.shape_log is None  # recording ends with the warm-up


@pytest.mark.e2e
def test_a_warm_engine_answers_as_a_cold_one(engine: LLMEngine, report: WarmupReport, tiny_llama_dir: Path) -> None:
    """The warm-up leaves nothing behind that changes a request's tokens (prefix cache, slots, seeds)."""
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True)
    cold = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", max_num_seqs=MAX_SEQS,
                                  max_num_batched_tokens=BUDGET, max_model_len=128, block_size=4,
                                  num_kv_blocks=256, max_loras=2))
    try:
        load(cold, LoRARequest("a", engine.list_loras(["a"])[0].path))
        tokens = []
        for each in (engine, cold):
            each.add_request("after", {"prompt_token_ids": [5, 6, 7, 8]}, params, LoRARequest("a"))
            finished = []
            while each.has_unfinished_requests():
                finished += [o for o in each.step() if o.finished]
            tokens.append(finished[0].outputs[0].token_ids)
        assert cold.stats().cold_step_shapes is None  # no warm-up: nothing to count against
    finally:
        cold.shutdown()
    assert len(tokens[0]) == 6 and tokens[0] == tokens[1]


def run_alone(engine: LLMEngine, request_id: str, length: int) -> None:
    engine.add_request(request_id, {"prompt_token_ids": [7] * length, "cache_salt": request_id},
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.e2e
def test_after_the_warm_up_each_kernel_it_never_ran_counts_once_as_cold(engine: LLMEngine,
                                                                        report: WarmupReport) -> None:
    before = engine.stats().cold_step_shapes
    assert before is not None
    run_alone(engine, "warm-kernels", 32)  # a prefill of 32 tokens, then decodes of one: both warmed
    assert engine.stats().cold_step_shapes == before
    # A one-token prompt is an eager step of one token, which no warm-up prefill is (Triton
    # specialises on 1): new once, however often it comes back.
    assert StepShape("eager", 1, False).kernels() not in {shape.kernels() for shape in report.shapes}
    run_alone(engine, "cold-kernels", 1)
    assert engine.stats().cold_step_shapes == before + 1
    run_alone(engine, "cold-kernels-again", 1)
    assert engine.stats().cold_step_shapes == before + 1


def test_a_step_shapes_kernels_are_its_graph_size_or_its_triton_specialisation() -> None:
    assert StepShape("graph", 48, True).kernels() == ("graph", 48, True)
    assert [StepShape("eager", n, False).kernels()[1] for n in (1, 16, 48, 17, 50)] == [1, 16, 16, 0, 0]


@pytest.mark.e2e
def test_the_engine_core_process_warms_up_and_answers_with_the_report(tiny_llama_dir: Path,
                                                                     make_adapter: Callable[..., Path]) -> None:
    """The WarmUp command crosses the pipe to the engine-core process (the worker's default on a
    GPU) and the report crosses back whole; the child counts cold kernels from then on."""
    adapter = make_adapter(tiny_llama_dir, seed=3)
    engine = ProcessEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", max_num_seqs=3,
                                        max_num_batched_tokens=32, max_model_len=64, block_size=4,
                                        num_kv_blocks=128, max_loras=1))

    async def run() -> tuple[WarmupReport, int | None]:
        await engine.add_lora(LoRARequest("only", str(adapter)))
        report = await engine.warm_up(["only"])
        return report, (await engine.get_stats()).cold_step_shapes

    try:
        report, cold = asyncio.run(run())
    finally:
        engine.shutdown()
    assert isinstance(report, WarmupReport) and report.resident == ("only",)
    assert {s.tokens for s in report.shapes if s.layout == "flat"} >= {1, 2, 3}
    assert cold == 0


def test_the_warm_up_refuses_an_engine_with_requests(engine: LLMEngine) -> None:
    engine.add_request("queued", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2))
    try:
        with pytest.raises(RuntimeError, match="before any traffic"):
            warm_up(engine)
    finally:
        engine.abort_request("queued")


def test_an_adapter_not_loaded_fails_the_warm_up_by_name(engine: LLMEngine) -> None:
    with pytest.raises(Exception, match="not-loaded"):
        warm_up(engine, ["not-loaded"])
    assert engine.runner.shape_log is None
    for request_id in engine.request_ids():
        engine.abort_request(request_id)


@pytest.mark.gpu
@pytest.mark.e2e
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_every_decode_bucket_and_prefill_length_replays_a_captured_graph(
        tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> None:
    seqs, budget = 32, 64
    cuda = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cuda", max_num_seqs=seqs,
                                  max_num_batched_tokens=budget, max_model_len=128, max_loras=2))
    try:
        load(cuda, LoRARequest("a", str(make_adapter(tiny_llama_dir, seed=1, target_modules=("q_proj", "down_proj")))))
        report = warm_up(cuda, ["a"])
        print(report.summary())
    finally:
        cuda.shutdown()
    graphs = {(s.tokens, s.lora) for s in report.shapes if s.layout == "graph"}
    buckets = [size for size in cuda.config.graph_sizes() if size <= seqs]
    assert buckets == [1, 2, 4, 8, 16, 32]
    # Every decode bucket, with the adapter in the batch (size 1: the base's last request).
    assert {(size, True) for size in buckets[1:]} | {(1, False)} <= graphs
    # Each prefill length up to the budget replays its bucket, base and adapter alike.
    assert {(n, lora) for n in prefill_lengths(budget, 126) if n <= budget for lora in (False, True)} <= graphs
    # No flat step ran uncaptured; the eager path ran for prompt logprobs.
    assert not any(s.layout == "flat" for s in report.shapes)
    assert any(s.layout == "eager" for s in report.shapes)
    assert report.sampler_paths == set(SAMPLER_PATHS) and report.resident == ("a",)
