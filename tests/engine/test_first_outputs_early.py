"""A step's first outputs handed on before the step's other tokens are processed
(``LLMEngine.step(on_first_outputs=...)``, wired by ``EngineCore`` to its ``emit_step``).

The same requests run on two engines of the same settings, one stepped with the callback and one
without; each step's callback outputs and returned outputs together must be what the other engine's
step returned (tokens, text, logprobs, finish reasons), the callback's being exactly the requests
that got their first token in that step, n siblings and first tokens that finish included, and none
of them returned again. Then the loop: ``EngineCore`` emits a step's first outputs in a call of
their own, ahead of the step's other outputs.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest

from serving.engine import LLM, EngineConfig, RequestOutput, SamplingParams
from serving.engine.engine_core import EngineCore
from serving.engine.engine_messages import AddRequest, Shutdown
from serving.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = dict(device="cpu", max_model_len=128, num_kv_blocks=128, block_size=4, max_num_seqs=8,
                max_num_batched_tokens=16, dtype="float32")
A_PROMPT = list(range(20, 30))
E_PROMPT = list(range(40, 52))
# Per step: the callback's calls, what step() returned, and the engine's generated-token counts
# before the step, at each call and after the step.
Step = tuple[list[list[RequestOutput]], list[RequestOutput], tuple[int, list[int], int]]


def _late_requests(stop_token: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Added while ``a`` decodes, all in one step: an n=2 seeded request (its siblings sample their
    first tokens in the step that forks them), one that ends at its first token by length and one by
    its stop token, a best_of (no output before it ends) and a prompt longer than a step's token
    budget (its first token comes steps later, beside the others' decodes)."""
    return {
        "b": (list(range(60, 66)), SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True,
                                                  logprobs=1)),
        "c": (list(range(70, 74)), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
        "e": (E_PROMPT, SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_token])),
        "d": (list(range(80, 85)), SamplingParams(n=1, best_of=3, temperature=1.0, seed=3, max_tokens=3,
                                                  ignore_eos=True)),
        "f": (list(range(90, 120)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
    }


def _run(tiny_llama_dir: Path, async_scheduling: bool, early: bool, stop_token: int) -> list[Step]:
    """Step the scenario to its end (``Step`` per step)."""
    llm = LLM(str(tiny_llama_dir), async_scheduling=async_scheduling, **SETTINGS)  # type: ignore[arg-type]
    engine = llm.llm_engine
    steps: list[Step] = []
    try:
        engine.add_request("a", {"prompt_token_ids": A_PROMPT},
                           SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, logprobs=2, stop=["\x00zz"]))
        while engine.has_unfinished_requests():
            if len(steps) == 3:
                for rid, (prompt, params) in _late_requests(stop_token).items():
                    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            calls: list[list[RequestOutput]] = []
            counts: list[int] = []

            def on_first(outputs: list[RequestOutput], engine: LLMEngine = engine) -> None:
                calls.append(outputs)
                counts.append(engine.counts.generation_tokens)

            before = engine.counts.generation_tokens
            returned = engine.step(on_first if early else None)
            steps.append((calls, returned, (before, counts, engine.counts.generation_tokens)))
            assert len(steps) < 60, "the scenario does not end"
    finally:
        engine.shutdown()
    return steps


def _comparable(output: RequestOutput) -> RequestOutput:
    """Everything but the first-token times (readings of the clock, another in each run)."""
    assert output.first_token_times is not None
    return dataclasses.replace(output, first_token_times=None)


def _first_token(tiny_llama_dir: Path) -> int:
    llm = LLM(str(tiny_llama_dir), **SETTINGS)  # type: ignore[arg-type]
    try:
        (out,) = llm.generate([{"prompt_token_ids": E_PROMPT}], SamplingParams(temperature=0, max_tokens=1))
    finally:
        llm.llm_engine.shutdown()
    return out.outputs[0].token_ids[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_first_outputs_come_before_the_rest_and_together_make_the_same_step(tiny_llama_dir: Path,
                                                                            async_scheduling: bool) -> None:
    stop_token = _first_token(tiny_llama_dir)
    want = _run(tiny_llama_dir, async_scheduling, early=False, stop_token=stop_token)
    got = _run(tiny_llama_dir, async_scheduling, early=True, stop_token=stop_token)
    assert len(got) == len(want)
    seen: set[str] = set()
    mixed = 0
    firsts: dict[str, RequestOutput] = {}
    for (calls, returned, counts), (_, expected, _) in zip(got, want):
        assert len(calls) <= 1, "one call a step"
        early = calls[0] if calls else []
        early_ids = [out.request_id for out in early]
        returned_ids = {out.request_id for out in returned}
        assert not set(early_ids) & returned_ids, "a first output returned again"
        assert not set(early_ids) & seen, "only a request's first output goes early"
        by_id = {out.request_id: _comparable(out) for out in early + returned}
        assert len(by_id) == len(early) + len(returned)
        assert by_id == {out.request_id: _comparable(out) for out in expected}
        before, at_call, after = counts
        if early and returned:
            # Handed on once the first tokens are appended (a best_of request's too), and before
            # any token of the step's other requests is.
            assert before + sum(len(comp.token_ids) for out in early for comp in out.outputs) <= at_call[0] < after
            mixed += 1
        for out in early + returned:
            if out.request_id not in seen:
                firsts[out.request_id] = out
        seen |= returned_ids | set(early_ids)
    # Every request's first output went early, but the best_of one, which shows nothing before its end.
    early_firsts = {out.request_id for calls, _, _ in got for call in calls for out in call}
    assert early_firsts == {"a", "b", "c", "e", "f"}
    assert mixed >= 2, "steps where first outputs and later ones meet"
    b, c, e = firsts["b"], firsts["c"], firsts["e"]
    assert [len(comp.token_ids) for comp in b.outputs] == [1, 1] and all(comp.logprobs for comp in b.outputs)
    assert (c.finished, c.outputs[0].finish_reason) == (True, "length")
    assert (e.finished, e.outputs[0].finish_reason, e.outputs[0].stop_reason) == (True, "stop", stop_token)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_core_emits_a_steps_first_outputs_in_a_call_of_their_own(tiny_llama_dir: Path,
                                                                      async_scheduling: bool) -> None:
    """``b`` comes while ``a`` decodes: the step that reads ``b``'s first token emits it alone, then
    the same step's token of ``a`` in the next call."""
    config = EngineConfig(model=str(tiny_llama_dir), async_scheduling=async_scheduling, **SETTINGS)  # type: ignore[arg-type]
    calls: list[list[RequestOutput]] = []
    a_decoding, b_done = threading.Event(), threading.Event()

    def emit_step(outputs: list[RequestOutput]) -> None:
        calls.append(list(outputs))
        for out in outputs:
            if out.request_id == "a" and len(out.outputs[0].token_ids) >= 2:
                a_decoding.set()
            if out.request_id == "b" and out.finished:
                b_done.set()

    unexpected: list[object] = []
    core = EngineCore(config, emit_step=emit_step, emit=lambda request_id, item: unexpected.append(item),
                      on_dead=unexpected.append)
    thread = threading.Thread(target=core.run, name="test-engine-core", daemon=True)
    thread.start()
    try:
        core.submit(AddRequest("a", SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), (None, A_PROMPT)))
        assert a_decoding.wait(60)
        core.submit(AddRequest("b", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), (None, E_PROMPT)))
        assert b_done.wait(60)
    finally:
        core.submit(Shutdown())
        thread.join(60)
    assert not unexpected or all(isinstance(item, RequestOutput) and item.request_id == "a" for item in unexpected)
    (first,) = [i for i, call in enumerate(calls) if any(out.request_id == "b" for out in call)][:1]
    assert [(out.request_id, len(out.outputs[0].token_ids)) for out in calls[first]] == [("b", 1)]
    a_before = max(len(out.outputs[0].token_ids) for call in calls[:first] for out in call if out.request_id == "a")
    assert [(out.request_id, len(out.outputs[0].token_ids)) for out in calls[first + 1]] == [("a", a_before + 1)]
