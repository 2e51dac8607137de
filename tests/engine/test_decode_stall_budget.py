"""The adaptive token budget (``EngineConfig.decode_stall_target``, serving.engine.step_cost): the
step-time model's fit on synthetic steps, the scheduler's budget from a fed model (smaller chunks
while sequences decode, the full budget when none do, the TTFT guard), the settings' checks, the
engine feeding the model each step's tokens (async scheduling one step late), and greedy tokens
equal with the option on and off."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.engine import LLM, SamplingParams
from serving.engine.block_manager import BlockManager
from serving.engine.config import EngineConfig
from serving.engine.scheduler import Scheduler, SchedulerOutput
from serving.engine.sequence import Sequence
from serving.engine.server.cli import parse_args
from serving.engine.server.worker import engine_config
from serving.engine.step_cost import MIN_PREFILL_CHUNK, StepCostFit, StepCostModel, stall_budget
from tests.engine.test_scheduler import _step  # schedule, then count and sample as the engine does

pytestmark = pytest.mark.usefixtures("one_thread")

# A line whose every value is exact in binary: 2^-7 s a step, 2^-16 s a token.
FIXED, PER_TOKEN = 2.0**-7, 2.0**-16


def _line_model(sizes: tuple[int, ...] = (1, 16, 256, 1024, 2048)) -> StepCostModel:
    model = StepCostModel()
    for tokens in sizes:
        model.observe(tokens, FIXED + PER_TOKEN * tokens)
    return model


def test_the_model_fits_the_line_of_synthetic_steps_and_ignores_stalls() -> None:
    model = StepCostModel()
    for tokens in (3, 5, 40, 300, 310, 1500, 2000):
        for _ in range(4):
            model.observe(tokens, FIXED + PER_TOKEN * tokens)
    model.observe(300, 50 * (FIXED + PER_TOKEN * 300))  # a stall: an allocator's growth, a collection
    model.observe(0, 1.0)  # a call that ran no step
    fit = model.fit()
    assert fit is not None
    assert math.isclose(fit.fixed, FIXED, rel_tol=1e-9) and math.isclose(fit.per_token, PER_TOKEN, rel_tol=1e-9)
    assert math.isclose(fit.seconds(1000), FIXED + 1000 * PER_TOKEN, rel_tol=1e-9)


def test_a_step_size_run_thousands_of_times_does_not_drown_the_others() -> None:
    model = _line_model()
    for _ in range(5000):  # a steady decode batch, measured a little slower than the line says
        model.observe(32, 1.1 * (FIXED + PER_TOKEN * 32))
    fit = model.fit()
    assert fit is not None and math.isclose(fit.per_token, PER_TOKEN, rel_tol=0.05)


def test_no_fit_until_enough_distinct_step_sizes_nor_from_steps_whose_size_costs_nothing() -> None:
    model = StepCostModel()
    for _ in range(100):
        model.observe(32, FIXED + PER_TOKEN * 32)
    assert model.fit() is None, "one size says nothing of a token's cost"
    model.observe(512, FIXED + PER_TOKEN * 512)
    assert model.fit() is None, "two sizes are not yet enough (min_bins=3)"
    model.observe(2048, FIXED + PER_TOKEN * 2048)
    assert model.fit() is not None
    flat = StepCostModel()
    for tokens in (1, 64, 512, 2048):
        flat.observe(tokens, 0.01)  # a host-bound engine: the token count changes nothing
    assert flat.fit() is None


def test_the_budget_keeps_the_step_within_the_target_of_the_decode_only_step() -> None:
    fit = StepCostFit(FIXED, PER_TOKEN)
    # t(64) = 2^-7 + 2^-10; twice that, less 2^-7, is 2^-7 + 2^-9: 640 tokens of 2^-16.
    assert stall_budget(fit, 64, 2.0, ceiling=2048) == 640
    assert fit.seconds(640) == 2 * fit.seconds(64)
    assert stall_budget(fit, 64, 2.0, ceiling=512) == 512, "max_num_batched_tokens stays the ceiling"
    assert stall_budget(fit, 64, 1.01, ceiling=2048) == 64 + MIN_PREFILL_CHUNK, "prompts always progress"


# ---- the scheduler with a fed model --------------------------------------------------------------


def _scheduler(tmp_path: Path, model: StepCostModel | None, **kwargs: float) -> Scheduler:
    config = EngineConfig(model=str(tmp_path), max_loras=0, block_size=16, **kwargs)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(1024, 16), None, step_cost=model)


def _seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(request_id=name, prompt=None, prompt_token_ids=list(range(1, prompt_len + 1)),
                    sampling_params=SamplingParams(), detokenizer=None)  # type: ignore[arg-type]


def _decoders(scheduler: Scheduler, count: int) -> None:
    for i in range(count):
        scheduler.add(_seq(f"short{i}", 3))
    _step(scheduler)  # their prompts: from the next step on they decode


# With 4 decodes, t(4) = 2^-7 + 2^-14; twice that, less 2^-7, over 2^-16: 520 tokens, 516 for the prompt.
LIMITED_CHUNK = 516


def test_a_prompt_gets_a_smaller_chunk_while_sequences_decode(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, _line_model(), decode_stall_target=2.0, decode_stall_max_wait_steps=64)
    _decoders(scheduler, 4)
    long = _seq("long", 3000)
    scheduler.add(long)
    out = _step(scheduler)
    assert [num for _, num in out.scheduled] == [1, 1, 1, 1, LIMITED_CHUNK]
    assert scheduler.stats.budget_limited_steps == 1


def test_a_prompt_gets_the_full_budget_when_nothing_decodes_or_the_option_is_off(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, _line_model(), decode_stall_target=2.0)
    long = _seq("long", 3000)
    scheduler.add(long)
    assert dict(_step(scheduler).scheduled) == {long: 2048}, "nothing decodes: nothing to stall"
    off = _scheduler(tmp_path, None)
    assert off.step_cost is None
    _decoders(off, 4)
    off.add(long := _seq("long", 3000))
    assert dict(_step(off).scheduled)[long] == 2044


def test_the_full_budget_until_the_model_has_a_fit(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, _line_model(sizes=(1, 16)), decode_stall_target=2.0)
    _decoders(scheduler, 4)
    scheduler.add(long := _seq("long", 3000))
    assert dict(_step(scheduler).scheduled)[long] == 2044
    assert scheduler.step_cost is not None
    scheduler.step_cost.observe(2048, FIXED + PER_TOKEN * 2048)  # a third size: the next step is limited
    assert dict(_step(scheduler).scheduled)[long] == LIMITED_CHUNK


def test_the_ttft_guard_gives_the_full_budget_once_a_prompt_has_waited_the_bound(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, _line_model(), decode_stall_target=2.0, decode_stall_max_wait_steps=3)
    _decoders(scheduler, 4)
    scheduler.add(long := _seq("long", 5000))
    chunks = [dict(_step(scheduler).scheduled)[long] for _ in range(4)]
    assert chunks == [LIMITED_CHUNK] * 3 + [2044], "waited 0, 1, 2 steps: limited; 3: the full budget"
    assert scheduler.stats.wait_guard_steps == 1
    # A prompt still queued counts as one in its prefill does (here the batch is full: it waits).
    full = _scheduler(tmp_path, _line_model(), decode_stall_target=2.0, decode_stall_max_wait_steps=3,
                      max_num_seqs=4)
    _decoders(full, 4)
    full.add(queued := _seq("queued", 100))
    guarded = []
    for _ in range(4):
        _step(full)
        guarded.append(full.stats.wait_guard_steps)
    assert guarded == [0, 0, 0, 1] and queued.num_computed_tokens == 0


# ---- settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "message"), [
    ({"decode_stall_target": 1.0}, "decode_stall_target must be None (off) or a number > 1"),
    ({"decode_stall_target": 0.5}, "decode_stall_target must be None (off) or a number > 1"),
    ({"decode_stall_target": float("nan")}, "decode_stall_target must be None (off) or a number > 1"),
    ({"decode_stall_target": float("inf")}, "decode_stall_target must be None (off) or a number > 1"),
    ({"decode_stall_max_wait_steps": 0}, "decode_stall_max_wait_steps must be >= 1, got 0"),
])
def test_a_bad_setting_is_refused_saying_what_is_wanted(tmp_path: Path, settings: dict[str, float],
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(model=str(tmp_path), **settings)  # type: ignore[arg-type]


def test_the_worker_flags_reach_the_engine(tiny_llama_dir: Path) -> None:
    config = engine_config(parse_args(["--model", str(tiny_llama_dir), "--decode-stall-target", "2.5",
                                       "--decode-stall-max-wait-steps", "7"]))
    assert (config.decode_stall_target, config.decode_stall_max_wait_steps) == (2.5, 7)
    default = engine_config(parse_args(["--model", str(tiny_llama_dir)]))
    assert default.decode_stall_target is None, "off by default"
    with pytest.raises(ValueError, match="decode_stall_target must be None"):
        engine_config(parse_args(["--model", str(tiny_llama_dir), "--decode-stall-target", "1"]))


# ---- the engine ----------------------------------------------------------------------------------

ENGINE_ARGS = dict(device="cpu", dtype="float32", max_loras=0, max_num_batched_tokens=256, max_model_len=1024,
                   block_size=16, num_kv_blocks=256, enable_prefix_caching=False)
# Three short prompts decode while a long one is prefilled in chunks.
PROMPTS = [{"prompt_token_ids": [300 + (7 * i + j) % 200 for j in range(length)]}
           for i, length in enumerate((8, 11, 9, 700))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Recorded(StepCostModel):
    """The model the engine feeds, each step's (tokens, seconds) kept."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, float]] = []

    def observe(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))
        super().observe(tokens, seconds)


class Fixed(StepCostModel):
    """A model of fixed costs, deaf to the steps' real times (a CPU's would vary from run to run):
    a token costs as much as a step, so each step that decodes gives prompts MIN_PREFILL_CHUNK."""

    def observe(self, tokens: int, seconds: float) -> None:
        pass

    def fit(self) -> StepCostFit | None:
        return StepCostFit(fixed=0.001, per_token=0.001)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> Iterator[dict[str, LLM]]:
    made = {"off": LLM(str(tiny_llama_dir), **ENGINE_ARGS),
            "on": LLM(str(tiny_llama_dir), decode_stall_target=2.0, **ENGINE_ARGS),
            "on-async": LLM(str(tiny_llama_dir), decode_stall_target=2.0, async_scheduling=True, **ENGINE_ARGS)}
    yield made
    for llm in made.values():
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("name", ["on", "on-async"])
def test_the_engine_feeds_the_model_every_step_it_ran(engines: dict[str, LLM], name: str) -> None:
    engine = engines[name].llm_engine
    engine.scheduler.step_cost = recorded = Recorded()
    engines[name].generate(PROMPTS, GREEDY)
    # Every token computed is timed once, under async scheduling with the step read (one step late).
    computed = sum(len(p["prompt_token_ids"]) for p in PROMPTS) + len(PROMPTS) * (GREEDY.max_tokens - 1)
    assert sum(tokens for tokens, _ in recorded.steps) == computed
    assert all(seconds > 0 for _, seconds in recorded.steps)


@pytest.mark.parametrize(("name", "timed"), [("on", [[9], [9, 1]]), ("on-async", [[], [9]])])
def test_each_call_times_the_step_it_waited_for(engines: dict[str, LLM], name: str, timed: list[list[int]]) -> None:
    """Without async scheduling a call runs its step; with it, the first call only launches one, and
    the second is timed as the step it read (the first), not as the one it launched."""
    engine = engines[name].llm_engine
    engine.scheduler.step_cost = recorded = Recorded()
    engine.add_request(f"timed-{name}", {"prompt_token_ids": list(range(300, 309))}, GREEDY)
    for expected in timed:
        engine.step()
        assert [tokens for tokens, _ in recorded.steps] == expected
    while engine.has_unfinished_requests():
        engine.step()


def test_greedy_tokens_are_the_same_with_the_budget_limited(engines: dict[str, LLM]) -> None:
    expected = [out.outputs[0].token_ids for out in engines["off"].generate(PROMPTS, GREEDY)]
    for name in ("on", "on-async"):
        scheduler = engines[name].llm_engine.scheduler
        scheduler.step_cost = Fixed()
        chunks: list[int] = []  # prompt tokens of each step that also decoded
        schedule = scheduler.schedule

        def recording() -> SchedulerOutput:
            out = schedule()
            if any(num == 1 for _, num in out.scheduled):
                chunks.append(sum(num for _, num in out.scheduled if num > 1))
            return out

        scheduler.schedule = recording  # type: ignore[method-assign]
        try:
            got = [out.outputs[0].token_ids for out in engines[name].generate(PROMPTS, GREEDY)]
        finally:
            del scheduler.schedule
        assert got == expected, name
        assert MIN_PREFILL_CHUNK in chunks and max(chunks) <= MIN_PREFILL_CHUNK, f"{name}: limited chunks {chunks}"


def test_the_budgets_decisions_are_counted_on_the_workers_metrics(engines: dict[str, LLM]) -> None:
    """What tunes the target and the guard on a live worker: /metrics counts the steps the model
    limited and those the guard overrode, as the scheduler counted them (zero with the option off)."""
    from prometheus_client.parser import text_string_to_metric_families

    from serving.engine.server.metrics import ServerMetrics

    def counters(engine_name: str) -> dict[str, float]:
        text = ServerMetrics().render(engines[engine_name].llm_engine.stats(), None).decode()
        return {sample.name: sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name.startswith("loraplex_engine_")}  # fmt: skip

    scheduler = engines["on"].llm_engine.scheduler
    scheduler.step_cost = Fixed()
    guard, scheduler.max_prompt_wait = scheduler.max_prompt_wait, 2  # the long prompt waits longer: it fires
    try:
        engines["on"].generate(PROMPTS, GREEDY)
    finally:
        scheduler.max_prompt_wait = guard
    stats = scheduler.stats
    assert stats.budget_limited_steps > 0 and stats.wait_guard_steps > 0
    on = counters("on")
    assert on["loraplex_engine_budget_limited_steps_total"] == stats.budget_limited_steps
    assert on["loraplex_engine_wait_guard_steps_total"] == stats.wait_guard_steps
    engines["off"].generate(PROMPTS, GREEDY)
    off = counters("off")
    assert off["loraplex_engine_budget_limited_steps_total"] == 0
    assert off["loraplex_engine_wait_guard_steps_total"] == 0
