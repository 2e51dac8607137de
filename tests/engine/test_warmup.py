"""The warm-up (serving.engine.warmup) on the tiny model: it runs every decode batch size up to
max_num_seqs, each prefill chunk length of its ladder (every captured graph size among them) with
and without an adapter, mixed steps of decodes and several prompts with many adapters, every
sampler path, and leaves the adapters named at launch in GPU slots; the shapes are those the runner
saw. After it, the first step of each kernel key it missed is recorded, logged and exported."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from serving.engine import EngineConfig, LoRARequest, SamplingParams
from serving.engine.config import graph_ladder
from serving.engine import llm_engine
from serving.engine.llm_engine import LLMEngine
from serving.engine.model_runner import StepShape
from serving.engine.process_engine import ProcessEngine
from serving.engine.warmup import SAMPLER_PATHS, WarmupReport, mixed_requests, prefill_lengths, warm_up, warmup_phases

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


def test_prefill_lengths_replay_every_captured_graph_size() -> None:
    """A lone prompt of n tokens is a flat step of n tokens: with the ladder's sizes among the
    lengths, every graph (the 320-1792 ones a serving step of decodes and chunks lands on) is run."""
    ladder = graph_ladder(2048)
    lengths = prefill_lengths(2048, 8190, ladder)
    assert set(ladder) <= set(lengths) and {320, 704, 1792} <= set(lengths)
    assert lengths[-1] == 3072  # still one past the budget, in two chunks
    assert set(prefill_lengths(2048, 500, ladder)) == {n for n in ladder if n <= 500} | {16, 32, 64, 128, 256}


def test_the_mixed_phase_uses_every_adapter_and_overfills_the_budget() -> None:
    turns = [f"a{k}" for k in range(32)] + [None]
    requests = mixed_requests(512, 2048, 8190, turns)
    assert {r.adapter for r in requests} == set(turns)
    lengths = [r.prompt_len for r in requests]
    assert min(lengths) >= 128 and max(lengths) < 384 and len(set(lengths)) > 100
    assert sum(lengths) > 16 * 2048  # many full-budget steps
    assert {r.params.max_tokens for r in requests} == set(range(1, 17))
    # A small context: prompt and output still fit it.
    assert all(r.prompt_len + r.params.max_tokens <= 20 for r in mixed_requests(40, 2048, 18, turns))


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
    # Steps that decoded some requests while others got their first token, with all three of the
    # base and the two adapters in one of them.
    assert report.mixed_steps > 0 and report.mixed_adapters == 3
    assert report.resident == ("a", "b") and report.not_resident == ()
    ladder, *_, mixed, paths = warmup_phases(engine, ["a", "b"])
    assert len(mixed) == 2 * MAX_SEQS and {r.adapter for r in mixed} == {"a", "b", None}
    assert report.requests == len(ladder) + 2 * len(prefill_lengths(BUDGET, 126)) + len(mixed) + len(paths)
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
    """A prompt of ``length`` tokens on the base, alone, to its end (3 tokens)."""
    engine.add_request(request_id, {"prompt_token_ids": [7] * length, "cache_salt": request_id},
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.e2e
def test_after_the_warm_up_each_kernel_it_never_ran_counts_once_as_cold(engine: LLMEngine, report: WarmupReport,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    before = engine.stats().cold_step_shapes
    assert before is not None
    run_alone(engine, "warm-kernels", 32)  # a prefill of 32 tokens, then decodes of one: both warmed
    assert engine.stats().cold_step_shapes == before
    # A one-token prompt is an eager step of one token, which no warm-up prefill is (Triton
    # specialises on 1): new once, however often it comes back.
    assert StepShape("eager", 1, False).kernels() not in {shape.kernels() for shape in report.shapes}
    caplog.set_level(logging.WARNING, logger="serving.engine.model_runner")
    run_alone(engine, "cold-kernels", 1)
    assert engine.stats().cold_step_shapes == before + 1
    run_alone(engine, "cold-kernels-again", 1)
    stats = engine.stats()
    assert stats.cold_step_shapes == before + 1
    # The first step of the key is kept (its kernels, its own token count) and said once.
    first = [step for step in stats.cold_steps if step.kernels == ("eager", 1, False)]
    assert len(first) == 1 and first[0].tokens == 1
    said = [r.getMessage() for r in caplog.records if "cold step" in r.getMessage() and "eager step (Triton key 1)" in r.getMessage()]
    assert len(said) == 1 and "of 1 tokens" in said[0], said


@pytest.mark.e2e
def test_after_the_warm_up_each_step_over_the_bound_counts_as_slow(engine: LLMEngine, report: WarmupReport,
                                                                  caplog: pytest.LogCaptureFixture,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With the bound at 0 every step is over it: a prefill and two decodes, each counted and said."""
    monkeypatch.setattr(llm_engine, "SLOW_STEP_S", 0.0)
    caplog.set_level(logging.WARNING, logger="serving.engine.llm_engine")
    before = engine.stats().slow_steps
    run_alone(engine, "slow", 8)
    assert engine.stats().slow_steps == before + 3
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("slow step")]
    assert len(said) == min(3, max(0, 20 - before)) and all("running" in line for line in said)


def test_a_step_shapes_kernels_are_its_graph_size_or_its_triton_specialisation() -> None:
    assert StepShape("graph", 48, True).kernels() == ("graph", 48, True)
    assert [StepShape("eager", n, False).kernels()[1] for n in (1, 16, 48, 17, 50)] == [1, 16, 16, 0, 0]


@pytest.mark.e2e
@pytest.mark.usefixtures("engine_core_forked")  # the child forked from the zygote, as in test_process_engine.py
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
        # Traffic unlike the warm-up's: a backlog of uneven prompts, base and adapter mixed.
        for i in range(3 * seqs):
            cuda.add_request(f"after-{i}", {"prompt_token_ids": [300 + i] * (1 + (i * 29) % 100)},
                             SamplingParams(temperature=0.7, max_tokens=1 + i % 9, ignore_eos=True),
                             LoRARequest("a") if i % 3 else None)
        while cuda.has_unfinished_requests():
            cuda.step()
        cold = cuda.stats().cold_steps
    finally:
        cuda.shutdown()
    graphs = {(s.tokens, s.lora) for s in report.shapes if s.layout == "graph"}
    buckets = [size for size in cuda.config.graph_sizes() if size <= seqs]
    assert buckets == [1, 2, 4, 8, 16, 32]
    # Every captured graph, with LoRA and without: the decode ladder's sizes and those a serving
    # step of decodes and prompt chunks lands on.
    assert {(size, lora) for size in cuda.config.graph_sizes() for lora in (False, True)} <= graphs
    assert {(n, lora) for n in prefill_lengths(budget, 126) if n <= budget for lora in (False, True)} <= graphs
    # No flat step ran uncaptured; the eager path ran for prompt logprobs.
    assert not any(s.layout == "flat" for s in report.shapes)
    assert any(s.layout == "eager" for s in report.shapes)
    assert report.sampler_paths == set(SAMPLER_PATHS) and report.resident == ("a",)
    assert report.mixed_steps > 0
    # The backlog afterwards met no graph the warm-up had not run.
    assert not [step for step in cold if step.kernels[0] == "graph"], cold
