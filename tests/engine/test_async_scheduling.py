"""Async scheduling (serving.engine.async_scheduling): each step is launched before the step in
flight is read, its decode rows taking their token ids from that step's samples on the device.

Every test runs the same requests on an engine with it and one without, and wants the same
outputs: tokens, text, finish and stop reasons, logprobs. Beyond that it checks what async
scheduling changes inside: a sequence that ended (a stop token or string, an abort) while its next
token was being computed had that token computed (one more sampled row than tokens emitted) and
never emitted; one that ends by length (``max_tokens``, the context) is not scheduled past it; a
step whose sampling must see tokens on the host (a grammar, penalties) is sampled only once the
step before is read. Models run in fp32 on the CPU; the gpu-marked runs do the same on CUDA with
graphs, where the feed and the sample copies are asynchronous for real.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.engine import LLM, AsyncEngine, EngineConfig, LoRARequest, RequestOutput, SamplingParams
from serving.engine.async_scheduling import Feed, host_bound
from serving.engine.guided import GuidedDecodingParams
from serving.engine.llm_engine import LLMEngine
from serving.engine.lora.integrity import SlotCorruptedError
from serving.engine.model_runner import PendingStep, StepLogits, StepResult
from serving.engine.outputs import Logprob
from serving.engine.sequence import Sequence
from serving.engine.server.cli import parse_args
from serving.engine.server.worker import engine_config

pytestmark = pytest.mark.usefixtures("one_thread")

_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", marks=_CUDA, id="cuda-graphs")]
ENGINE_ARGS: dict[str, Any] = dict(max_loras=2, max_lora_rank=16, max_num_seqs=6, max_model_len=128, block_size=4,
                                   num_kv_blocks=96, dtype="float32")
PROMPTS = ["The quick brown fox", "Once upon a time", "Hello! How are you today?"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, make_adapter: Callable[..., Path]) -> list[LoRARequest]:
    return [LoRARequest(f"ad{i}", str(make_adapter(tiny_llama_dir, r=8, seed=20 + i, init_scale=0.5)))
            for i in range(2)]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> Iterator[Callable[[str], dict[bool, LLM]]]:
    """``engines(device)``: an LLM without async scheduling and one with it (False, True)."""
    made: dict[str, dict[bool, LLM]] = {}

    def get(device: str) -> dict[bool, LLM]:
        if device not in made:
            made[device] = {flag: LLM(str(tiny_llama_dir), device=device, async_scheduling=flag, **ENGINE_ARGS)
                            for flag in (False, True)}
        return made[device]

    yield get
    for pair in made.values():
        for llm in pair.values():
            llm.llm_engine.shutdown()


class Launches:
    """What the engine queues: each step's forward (the sequences it feeds from the step in flight,
    and those whose sampling reads host state besides), its sampling (rows per request), and the
    order in which steps' forwards, samplings and reads come."""

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sampled: Counter[str] = Counter()  # sampled rows per request
        self.fed: list[Sequence] = []  # sequences whose input token came from the step in flight
        self.host_bound: set[int] = set()  # steps that feed a sequence whose sampling reads host state
        self.events: list[str] = []
        self.forwards = 0
        # Each forward's number by its result's id (a step is sampled before the next forward,
        # so an id reused once a result is gone names the newest).
        numbers: dict[int, int] = {}
        forward, sample = engine.runner.forward, engine.runner.sample

        def spy_forward(scheduled: list[tuple[Sequence, int]], *, flat: bool | None = None,
                        feed: Feed | None = None) -> StepLogits:
            self.forwards += 1
            number = self.forwards
            fed = [seq for seq, _ in scheduled if seq.num_pending]
            self.fed += fed
            if any(host_bound(seq) for seq in fed):
                self.host_bound.add(number)
            self.events.append(f"forward {number}")
            logits = forward(scheduled, flat=flat, feed=feed)
            numbers[id(logits)] = number
            return logits

        def spy_sample(logits: StepLogits) -> PendingStep:
            number = numbers[id(logits)]
            self.events.append(f"sample {number}")
            step = sample(logits)
            self.sampled.update(seq.request_id for seq in step.sampled)
            read = step.result

            def result() -> StepResult:
                self.events.append(f"read {number}")
                return read()

            monkeypatch.setattr(step, "result", result)
            return step

        monkeypatch.setattr(engine.runner, "forward", spy_forward)
        monkeypatch.setattr(engine.runner, "sample", spy_sample)

    def sampled_after_read(self, number: int) -> bool:
        """Step ``number`` was sampled after the step before it was read."""
        return self.events.index(f"sample {number}") > self.events.index(f"read {number - 1}")


def _run(llm: LLM, prompts: list[Any], params: list[SamplingParams], loras: list[LoRARequest | None],
         monkeypatch: pytest.MonkeyPatch) -> tuple[list[RequestOutput], Launches]:
    with monkeypatch.context() as patch:
        launches = Launches(llm.llm_engine, patch)
        outputs = llm.generate(prompts, params, lora_request=loras)
    return outputs, launches


def _assert_same_logprobs(ours: list[dict[int, Logprob] | None], want: list[dict[int, Logprob] | None]) -> None:
    assert len(ours) == len(want)
    for got, expected in zip(ours, want):
        if expected is None:
            assert got is None
            continue
        assert got is not None and got.keys() == expected.keys()
        assert [(v.rank, pytest.approx(v.logprob, abs=1e-5)) for v in got.values()] == [
            (v.rank, v.logprob) for v in expected.values()]


def _assert_same(ours: list[RequestOutput], want: list[RequestOutput]) -> None:
    for a, b in zip(ours, want, strict=True):
        assert len(a.outputs) == len(b.outputs)
        if b.prompt_logprobs is not None:
            assert a.prompt_logprobs is not None
            _assert_same_logprobs(a.prompt_logprobs, b.prompt_logprobs)
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
                y.token_ids, y.text, y.finish_reason, y.stop_reason), a.request_id
            if y.logprobs is not None:
                assert x.logprobs is not None
                _assert_same_logprobs(list(x.logprobs), list(y.logprobs))
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_each_step_is_launched_before_the_one_before_is_read(
    async_scheduling: bool, engines: Callable[[str], dict[bool, LLM]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host never waits for step N's tokens before it launches step N+1, forward and sampling
    (without async scheduling it reads each step before the next)."""
    engine = engines("cpu")[async_scheduling].llm_engine
    launches = Launches(engine, monkeypatch)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"order-{i}", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # Four steps: the prompts' (each samples a first token), then three decodes.
    if async_scheduling:
        assert launches.events == ["forward 1", "sample 1", "forward 2", "sample 2", "read 1", "forward 3", "sample 3",
                                   "read 2", "forward 4", "sample 4", "read 3", "read 4"]
    else:
        assert launches.events == ["forward 1", "sample 1", "read 1", "forward 2", "sample 2", "read 2", "forward 3",
                                   "sample 3", "read 3", "forward 4", "sample 4", "read 4"]


@pytest.mark.parametrize("device", DEVICES)
def test_stops_and_limits_are_exact_and_the_token_past_a_stop_is_dropped(
    device: str, engines: Callable[[str], dict[bool, LLM]], adapters: list[LoRARequest],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llms = engines(device)
    loras: list[LoRARequest | None] = [None, *adapters]
    free = llms[False].generate(PROMPTS, GREEDY, lora_request=loras)
    prompts, params, lora_of, ends = [], [], [], []
    for prompt, lora, out in zip(PROMPTS, loras, free):
        tokens, text = out.outputs[0].token_ids, out.outputs[0].text
        middle = len(text) // 2
        for sampling, end in (
            (SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[tokens[5]]), "stop"),
            (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[text[middle : middle + 3]]), "stop"),
            (SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), "length"),
        ):
            prompts.append(prompt)
            params.append(sampling)
            lora_of.append(lora)
            ends.append(end)

    want, plain = _run(llms[False], prompts, params, lora_of, monkeypatch)
    ours, overlapped = _run(llms[True], prompts, params, lora_of, monkeypatch)
    _assert_same(ours, want)
    assert [o.outputs[0].finish_reason for o in want] == ends
    assert plain.fed == [], "without async scheduling every token is read before the next step"
    assert overlapped.fed, "with it decode rows take their tokens from the step in flight"
    for out, reference, end in zip(ours, want, ends):
        emitted = len(out.outputs[0].token_ids)
        assert plain.sampled[reference.request_id] == emitted
        if end == "stop":
            assert overlapped.sampled[out.request_id] == emitted + 1, "the step after the stop computed one more"
        else:
            assert overlapped.sampled[out.request_id] == emitted, "max_tokens is known: no step past it"
    stats = llms[True].llm_engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


@pytest.mark.parametrize("device", DEVICES)
def test_an_abort_never_emits_the_token_in_flight(
    device: str, engines: Callable[[str], dict[bool, LLM]], adapters: list[LoRARequest],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llms = engines(device)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    loras: list[LoRARequest | None] = [adapters[0], None, adapters[1]]
    want = llms[False].generate(PROMPTS, params, lora_request=loras)
    engine = llms[True].llm_engine
    launches = Launches(engine, monkeypatch)
    for i, (prompt, lora) in enumerate(zip(PROMPTS, loras)):
        engine.add_request(f"abort-{i}", prompt, params, lora)
    latest: dict[str, RequestOutput] = {}
    while "abort-0" not in latest or len(latest["abort-0"].outputs[0].token_ids) < 3:
        latest.update((o.request_id, o) for o in engine.step())

    aborted = engine.abort_request("abort-0")
    assert aborted is not None and aborted.finished and aborted.outputs[0].finish_reason == "abort"
    emitted = aborted.outputs[0].token_ids
    assert emitted == want[0].outputs[0].token_ids[: len(emitted)]
    assert launches.sampled["abort-0"] == len(emitted) + 1, "its next token was in flight when it was aborted"
    after: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        after += engine.step()
    engine.step()  # reads the last step in flight
    assert "abort-0" not in {o.request_id for o in after}, "nothing comes out of an aborted request"
    assert launches.sampled["abort-0"] == len(emitted) + 1, "an aborted sequence is never scheduled again"
    finals = {o.request_id: o for o in after if o.finished}
    for i in (1, 2):
        assert finals[f"abort-{i}"].outputs[0].token_ids == want[i].outputs[0].token_ids
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0
    assert {info.name: info.active_requests for info in engine.list_loras()} == {"ad0": 0, "ad1": 0}


@pytest.mark.e2e
@pytest.mark.parametrize("device", DEVICES)
def test_requests_that_need_their_tokens_on_the_host_are_read_first(
    device: str, engines: Callable[[str], dict[bool, LLM]], adapters: list[LoRARequest],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that feeds a sequence with a grammar or penalties, or whose token in flight reaches
    its min_tokens, is sampled only once the step in flight is read (its forward is queued before,
    like any other's); every other step is sampled as soon as its forward is queued. Logprobs,
    seeded sampling and n / best_of forks need nothing of the host. The outputs are those of an
    engine without async scheduling throughout."""
    llms = engines(device)
    free = llms[False].generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids
    guided = SamplingParams(temperature=0, max_tokens=40, guided_decoding=GuidedDecodingParams(regex="[a-z]{3,12}"))
    for llm in llms.values():  # the grammar compiled and cached: its request starts with the others
        llm.generate(PROMPTS[0], guided)
    batches: list[list[tuple[SamplingParams, LoRARequest | None]]] = [
        [
            (guided, None),
            (SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.5, repetition_penalty=1.3), adapters[0]),
            (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), adapters[1]),
        ],
        # Each stop token first comes at an index below some of these min_tokens and equal to others.
        [(SamplingParams(temperature=0, max_tokens=16, min_tokens=m, stop_token_ids=[free[1], free[4]]), None)
         for m in range(1, 7)],
        [
            (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3), adapters[1]),
            (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2), adapters[0]),
            (SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, max_tokens=12, ignore_eos=True),
             adapters[0]),
            (SamplingParams(n=2, best_of=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True), adapters[1]),
            (SamplingParams(n=3, temperature=0.7, seed=9, max_tokens=9, ignore_eos=True, logprobs=1), None),
        ],
    ]
    for number, cases in enumerate(batches):
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
        params = [p for p, _ in cases]
        loras = [lora for _, lora in cases]
        want, _ = _run(llms[False], prompts, params, loras, monkeypatch)
        ours, launches = _run(llms[True], prompts, params, loras, monkeypatch)
        _assert_same(ours, want)
        assert launches.fed, f"batch {number}: decode rows are fed from the step in flight"
        steps = launches.forwards
        for step in range(1, steps + 1):
            if step in launches.host_bound:
                assert launches.sampled_after_read(step), f"batch {number}: step {step} sampled too early"
            else:
                forward = launches.events.index(f"forward {step}")
                assert launches.events[forward + 1] == f"sample {step}", f"batch {number}: step {step} waited"
        if number == 0:
            assert want[0].outputs[0].finish_reason == "stop" and want[0].outputs[0].text.isalpha()
            fed = {seq.request_id for seq in launches.fed}
            assert {ours[0].request_id, ours[1].request_id} <= fed, "grammar and penalty rows are fed too"
            assert 0 < len(launches.host_bound) < steps, "steps after the grammar and penalties end overlap whole"
        if number == 1:
            assert 0 < len(launches.host_bound) < steps, "only the steps where min_tokens is reached wait"
        if number == 2:
            assert not launches.host_bound
            assert any(seq.request_id == ours[-1].request_id and seq.index > 0 for seq in launches.fed), \
                "forked siblings are fed"


def test_the_context_limit_is_never_passed(
    engines: Callable[[str], dict[bool, LLM]], monkeypatch: pytest.MonkeyPatch
) -> None:
    llms = engines("cpu")
    context = ENGINE_ARGS["max_model_len"]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 500 + 5 for j in range(context - 6 - i)]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    want, _ = _run(llms[False], prompts, [params] * 3, [None] * 3, monkeypatch)
    ours, launches = _run(llms[True], prompts, [params] * 3, [None] * 3, monkeypatch)
    _assert_same(ours, want)
    for out in ours:
        assert out.outputs[0].finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == context
        assert launches.sampled[out.request_id] == len(out.outputs[0].token_ids), "no step past the context"


def test_slot_checks_between_steps_read_the_step_in_flight(
    engines: Callable[[str], dict[bool, LLM]], adapters: list[LoRARequest]
) -> None:
    """``verify_slots`` (between two steps, as the worker runs it) first reads the step in flight,
    whose outputs the next step hands out."""
    llms = engines("cpu")
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    want = llms[False].generate(PROMPTS, params, lora_request=[adapters[0], adapters[1], None])
    engine = llms[True].llm_engine
    for i, (prompt, lora) in enumerate(zip(PROMPTS, [adapters[0], adapters[1], None])):
        engine.add_request(f"verify-{i}", prompt, params, lora)
    finals: dict[str, RequestOutput] = {}
    streamed: Counter[str] = Counter()
    while len(finals) < 3:
        for out in engine.step():
            streamed[out.request_id] += 1
            if out.finished:
                finals[out.request_id] = out
        assert engine.verify_slots() == []
    for i in range(3):
        assert finals[f"verify-{i}"].outputs[0].token_ids == want[i].outputs[0].token_ids
        assert streamed[f"verify-{i}"] == len(want[i].outputs[0].token_ids), "one output per token, none lost"


def test_a_corrupted_slot_requeues_a_prompt_whose_first_token_is_in_flight(
    tiny_llama_dir: Path, make_adapter: Callable[..., Path], engines: Callable[[str], dict[bool, LLM]]
) -> None:
    """A sequence whose prompt the step in flight completes has produced nothing the host has seen,
    yet its first token exists: ``verify_slots`` reads that step before it stops or requeues what
    runs on a corrupted slot, so the sequence is stopped with its token (it has output now), and
    the one still prefilling is served whole after the repair, as without async scheduling."""
    lora = LoRARequest("checked", str(make_adapter(tiny_llama_dir, r=8, seed=43, init_scale=0.5)))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = {"first": PROMPTS[0], "second": "Once upon a time there was a little girl who lived in a village"}
    want = {rid: out.outputs[0].token_ids
            for rid, out in zip(prompts, engines("cpu")[False].generate(list(prompts.values()), params,
                                                                          lora_request=lora))}
    llm = LLM(str(tiny_llama_dir), max_loras=1, max_lora_rank=16, device="cpu", max_model_len=64, num_kv_blocks=64,
              max_num_seqs=2, max_num_batched_tokens=8, dtype="float32", async_scheduling=True)
    engine = llm.llm_engine
    try:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, params, lora)
        outputs: dict[str, RequestOutput] = {}

        def step() -> None:
            outputs.update((o.request_id, o) for o in engine.step())
            engine.wait_for_loads(0.01)

        def first_token_in_flight() -> bool:
            running = {seq.request_id: seq for seq in engine.scheduler.running}
            seq = running.get("first")
            return seq is not None and seq.num_pending == 1 and seq.num_output_tokens == 0

        while not first_token_in_flight():
            step()
        second = next(seq for seq in engine.scheduler.running if seq.request_id == "second")
        assert second.num_computed_tokens < second.num_prompt_tokens, "the second prompt is still prefilling"
        layer = next(iter(engine.runner.model.lora_layers()))
        with torch.no_grad():
            layer.lora_B[0][engine.list_loras()[0].gpu_row or 0, 1] += 1.0
        (repair,) = engine.verify_slots()
        assert repair.stopped == 1, "the first sequence has a token once the step in flight is read"
        while engine.has_unfinished_requests() or "first" not in outputs:
            step()
        assert isinstance(outputs["first"].error, SlotCorruptedError)
        assert outputs["first"].outputs[0].token_ids == want["first"][:1]
        assert outputs["second"].error is None and outputs["second"].outputs[0].token_ids == want["second"]
    finally:
        engine.shutdown()


def test_streaming_and_abort_through_the_async_engine(
    tiny_llama_dir: Path, engines: Callable[[str], dict[bool, LLM]]
) -> None:
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    want = engines("cpu")[False].generate(PROMPTS[1], GREEDY)[0].outputs[0]
    engine = AsyncEngine.from_args(str(tiny_llama_dir), device="cpu", async_scheduling=True, **ENGINE_ARGS)

    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        async def abort_after_three() -> list[RequestOutput]:
            seen = []
            async for out in engine.generate(PROMPTS[0], long, "streamed-abort"):
                seen.append(out)
                if len(seen) == 3:
                    await engine.abort("streamed-abort")
            return seen

        async def whole() -> list[RequestOutput]:
            return [out async for out in engine.generate(PROMPTS[1], GREEDY, "streamed-whole")]

        return await asyncio.gather(abort_after_three(), whole())

    try:
        aborted, streamed = asyncio.run(run())
        stats = asyncio.run(engine.get_stats())
    finally:
        engine.shutdown()
    assert aborted[-1].finished and aborted[-1].outputs[0].finish_reason == "abort"
    assert len(aborted[-1].outputs[0].token_ids) < 200
    assert streamed[-1].outputs[0].token_ids == want.token_ids and streamed[-1].outputs[0].text == want.text
    assert stats.kv_blocks_used == 0 and stats.num_running == 0


def test_the_option_and_the_worker_flag(tiny_llama_dir: Path) -> None:
    assert EngineConfig(model=str(tiny_llama_dir)).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling is not supported with tensor_parallel_size"):
        EngineConfig(model=str(tiny_llama_dir), device="cpu", async_scheduling=True, tensor_parallel_size=2)
    model = ["--model", str(tiny_llama_dir)]
    assert engine_config(parse_args([*model, "--async-scheduling"])).async_scheduling is True
    assert engine_config(parse_args([*model, "--device", "cuda:0" if torch.cuda.is_available() else "cpu",
                                     "--no-async-scheduling"])).async_scheduling is False  # fmt: skip
    # The worker's default: on for one CUDA device, off on CPU and for a sharded model.
    assert engine_config(parse_args([*model, "--device", "cpu"])).async_scheduling is False
    assert engine_config(parse_args([*model, "--device", "cpu", "-tp", "2"])).async_scheduling is False
    cuda = torch.cuda.is_available()
    assert engine_config(parse_args(model)).async_scheduling is cuda
    if cuda:
        assert engine_config(parse_args([*model, "--device", "cuda"])).async_scheduling is True
