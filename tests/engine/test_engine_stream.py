"""A request's stream of outputs on its caller's loop (serving.engine.engine_client.Stream): what
``generate()`` reads of outputs that waited, and that a read waits for the next put."""

from __future__ import annotations

import asyncio

from serving.engine.engine_client import Stream, _put_all
from serving.engine.outputs import RequestOutput


def output(tokens: int, *, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], outputs=[], finished=finished,
                         num_generated_tokens=tokens)


def test_of_outputs_that_waited_only_the_newest_is_read() -> None:
    async def run() -> list[int]:
        stream = Stream(asyncio.get_running_loop())
        for tokens in (1, 2, 3):
            stream.put(output(tokens))
        first = await stream.get()
        stream.put(output(4))
        second = await stream.get()
        assert isinstance(first, RequestOutput) and isinstance(second, RequestOutput)
        return [first.num_generated_tokens, second.num_generated_tokens]

    assert asyncio.run(run()) == [3, 4]


def test_a_last_output_or_a_failure_is_never_skipped() -> None:
    async def run() -> None:
        stream = Stream(asyncio.get_running_loop())
        failure = RuntimeError("engine gone")
        for item in (output(1), output(2, finished=True), output(3), failure, output(4)):
            stream.put(item)
        last = await stream.get()
        assert isinstance(last, RequestOutput) and last.finished and last.num_generated_tokens == 2
        assert await stream.get() is failure
        after = await stream.get()
        assert isinstance(after, RequestOutput) and after.num_generated_tokens == 4

    asyncio.run(run())


def test_a_read_waits_for_the_next_put_even_after_a_cancelled_read() -> None:
    async def run() -> int:
        loop = asyncio.get_running_loop()
        stream = Stream(loop)
        cancelled = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        cancelled.cancel()
        reader = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        assert not reader.done()
        loop.call_soon(stream.put, output(7))
        item = await asyncio.wait_for(reader, 5)
        assert isinstance(item, RequestOutput)
        return item.num_generated_tokens

    assert asyncio.run(run()) == 7


def test_a_steps_first_tokens_wake_their_readers_before_the_other_streams() -> None:
    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        streams = {name: Stream(loop) for name in ("old-a", "new-a", "old-b", "new-b")}
        for name in ("old-a", "old-b"):  # these have streamed a token already
            streams[name].put(output(1))
            await streams[name].get()
        resumed: list[str] = []

        async def read(name: str) -> None:
            await streams[name].get()
            resumed.append(name)

        readers = [asyncio.create_task(read(name)) for name in streams]
        await asyncio.sleep(0)  # every reader waits
        _put_all([(streams[name], output(2)) for name in ("old-a", "new-a", "old-b", "new-b")])
        await asyncio.gather(*readers)
        return resumed

    assert asyncio.run(run()) == ["new-a", "new-b", "old-a", "old-b"]
