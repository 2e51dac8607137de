"""Where the engine stamps a request's way to its first token (serving.engine.outputs.FirstTokenTimes):
the queue phase from its add to the step that first schedules its prompt, the prefill phase from
there over every chunk to its first token read, each wall-clock reading beside the monotonic one
it pairs with and in the order that keeps the gap between them out of the phases, and the same
times on every output from the first token on.

The engine's clock is a counter here: each reading, monotonic or wall, is the next tick, so the
phases come out in readings (a 20-token prompt in chunks of 8 is scheduled by three steps).
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving.engine import LLM, SamplingParams
from serving.engine import llm_engine
from serving.engine.outputs import FirstTokenTimes, RequestOutput

WALL_S = 1_000  # the wall clock's reading at tick 0, in seconds


class Ticks:
    def __init__(self) -> None:
        self.tick = 0

    def monotonic(self) -> float:
        self.tick += 1
        return float(self.tick)

    def time_ns(self) -> int:
        self.tick += 1
        return (WALL_S + self.tick) * 10**9


def wall(tick: int) -> int:
    return (WALL_S + tick) * 10**9


@pytest.mark.parametrize("early", [False, True], ids=["returned", "first-outputs-early"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_queue_and_prefill_phases_and_their_wall_clock_ends(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                            async_scheduling: bool, early: bool) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, num_kv_blocks=64, max_num_seqs=2,
              max_num_batched_tokens=8, dtype="float32", async_scheduling=async_scheduling)
    engine = llm.llm_engine
    ticks = Ticks()
    monkeypatch.setattr(llm_engine, "time", SimpleNamespace(monotonic=ticks.monotonic, time_ns=ticks.time_ns,
                                                            perf_counter=time.perf_counter))
    try:
        engine.add_request("r", {"prompt_token_ids": list(range(20, 40))}, SamplingParams(max_tokens=3, ignore_eos=True))
        outputs: list[RequestOutput] = []
        while engine.has_unfinished_requests():
            # Handed on early (LLMEngine.step's on_first_outputs), the first output has the same stamps.
            returned = engine.step(outputs.extend if early else None)
            outputs += returned
    finally:
        engine.shutdown()
    # Ticks: 1 the add's wall clock, 2 its monotonic one; 3, 4, 5 the three prompt steps (the first
    # schedules it); then the first token read: its monotonic reading, then its wall clock. Under async
    # scheduling a fourth step (the first decode) is launched before the first token is read.
    read = 6 if not async_scheduling else 7
    want = FirstTokenTimes(added_ns=wall(1), queue=3.0 - 2.0, prefill=read - 3.0, first_token_ns=wall(read + 1))
    assert [len(out.outputs[0].token_ids) for out in outputs] == [1, 2, 3]
    assert [out.first_token_times for out in outputs] == [want] * 3
