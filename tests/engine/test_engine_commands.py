"""The engine's one command layer (serving.engine.engine_messages, EngineCore.handle): every command
has one EngineCore method, both drivers carry commands to it unchanged, an unknown command is an
error, and a prompt's cache salt reaches the engine as the salt.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
from contextlib import aclosing
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from multiprocessing import Pipe
from pathlib import Path
from typing import cast, get_args

import pytest

from serving.engine import AsyncEngine, RequestOutput, SamplingParams
from serving.engine.engine_core import EngineCore, Reply
from serving.engine.engine_core_child import _Channel, _listen
from serving.engine.engine_messages import (
    AbortRequest,
    AddRequest,
    DropRequest,
    EngineCommand,
    GetStats,
    ListLoras,
    Shutdown,
)

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# As long as the engine's 128 positions allow: a request that finished before its stream is left
# sends no DropRequest (4 tokens could all be generated first on a loaded machine: a CI run).
LONG = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
TIMEOUT_S = 60.0

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine.from_args(str(tiny_llama_dir), max_num_seqs=4, max_model_len=128, block_size=4,
                                   num_kv_blocks=64, device="cpu")
    yield engine
    engine.shutdown()


def test_every_command_has_one_core_method() -> None:
    assert set(EngineCore.HANDLERS) == set(get_args(EngineCommand))
    for command, handler in EngineCore.HANDLERS.items():
        assert getattr(EngineCore, handler.__name__) is handler, command  # a method of the core, not a twin


def test_commands_cross_a_pipe_whole() -> None:
    add = AddRequest("r", GREEDY, ("hi", [1, 2]), priority=3, cache_salt="tenant-1")
    assert pickle.loads(pickle.dumps(add)) == add
    with pytest.raises(AttributeError):
        add.cache_salt = "tenant-2"  # type: ignore[misc]  # frozen: what was sent is what runs


def test_an_unknown_command_is_an_error(engine: AsyncEngine) -> None:
    @dataclass(frozen=True)
    class Reboot:
        pass

    answers: list[tuple[bool, object]] = []
    answered = threading.Event()

    def reply(ok: bool, value: object) -> None:
        answers.append((ok, value))
        answered.set()

    engine._core.submit(Reboot())  # type: ignore[arg-type]  # unanswered: logged, and the loop goes on
    engine._core.submit(Reboot(), reply)  # type: ignore[arg-type]
    assert answered.wait(TIMEOUT_S)
    [(ok, error)] = answers
    assert not ok and isinstance(error, TypeError) and "Reboot" in str(error)
    assert engine.is_running and asyncio.run(engine.get_stats()).num_running == 0


def test_the_thread_driver_dispatches_through_the_core(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    handled: list[EngineCommand] = []
    handle = engine._core.handle

    def spy(command: EngineCommand, reply: Reply | None = None) -> None:
        handled.append(command)
        handle(command, reply)

    monkeypatch.setattr(engine._core, "handle", spy)

    async def run() -> None:
        await engine.get_stats()
        await engine.list_loras(["none"])
        stream = cast(AsyncGenerator[RequestOutput, None],  # generate() is one; its type says AsyncIterator
                      engine.generate({"prompt_token_ids": [5, 6, 7], "cache_salt": "tenant-7"}, LONG, "spied"))
        async with aclosing(stream):
            await anext(stream)  # then leaving early drops it
        await engine.abort("spied")

    asyncio.run(run())
    assert [type(c) for c in handled] == [GetStats, ListLoras, AddRequest, DropRequest, AbortRequest]
    assert handled[1] == ListLoras(("none",))
    add = handled[2]
    assert isinstance(add, AddRequest) and add.cache_salt == "tenant-7" and add.encoded == (None, [5, 6, 7])


def test_the_salt_reaches_the_engine_as_the_salt(engine: AsyncEngine) -> None:
    core = engine._core
    seen: dict[str, str | None] = {}
    done = threading.Event()

    def look(ok: bool, value: object) -> None:
        # A reply runs on the loop's thread, between steps, where the engine's state may be read.
        for request_id in ("salted", "unsalted"):
            seen[request_id] = core.engine._requests[request_id].first.cache_salt
        done.set()

    queued = threading.Event()

    def hold(ok: bool, value: object) -> None:
        queued.wait(TIMEOUT_S)  # the loop waits here until all is queued, then drains it: no step between

    core.submit(GetStats(), hold)
    core.submit(AddRequest("salted", GREEDY, (None, [5, 6, 7]), cache_salt="tenant-9"))
    core.submit(AddRequest("unsalted", GREEDY, (None, [5, 6, 7])))
    core.submit(GetStats(), look)
    core.submit(DropRequest("salted"))
    core.submit(DropRequest("unsalted"))
    queued.set()
    assert done.wait(TIMEOUT_S)
    assert seen == {"salted": "tenant-9", "unsalted": None}


class _FakeCore:
    def __init__(self) -> None:
        self.submitted: list[tuple[EngineCommand, Reply | None]] = []

    def submit(self, command: EngineCommand, reply: Reply | None = None) -> None:
        self.submitted.append((command, reply))


def test_the_child_submits_what_the_pipe_brings_unchanged() -> None:
    parent, child = Pipe()
    core = _FakeCore()
    listener = threading.Thread(target=_listen, args=(core, _Channel(child)), daemon=True)
    listener.start()
    add = AddRequest("r", GREEDY, (None, [1, 2]), cache_salt="tenant-3")
    for message in ((None, add), (7, GetStats()), (None, Shutdown())):
        parent.send(message)
    listener.join(TIMEOUT_S)
    assert not listener.is_alive()  # a Shutdown ends the listener
    (got_add, no_reply), (stats, reply), (shutdown, _) = core.submitted
    assert got_add == add and got_add.cache_salt == "tenant-3" and no_reply is None
    assert stats == GetStats() and isinstance(shutdown, Shutdown) and reply is not None
    reply(True, "answer")  # the answer names its call
    assert parent.recv() == ("reply", 7, True, "answer")


def test_a_closed_pipe_stops_the_core() -> None:
    parent, child = Pipe()
    core = _FakeCore()
    listener = threading.Thread(target=_listen, args=(core, _Channel(child)), daemon=True)
    listener.start()
    parent.close()
    listener.join(TIMEOUT_S)
    assert [type(command) for command, _ in core.submitted] == [Shutdown]
