"""A request's Redis scripts and commands in one round trip.

A request talks to Redis twice: before its upstream call (the token buckets' admission and the
version's breaker permit) and after it (the refund, the breaker's and the prewarm model's counts,
the usage record and the key's spend). Each of those is one pipeline here, so one round trip.

redis-py runs a registered script with EVALSHA, and in a pipeline it first asks SCRIPT EXISTS for
every script queued, a round trip of its own on every execution. Here scripts go out as EVALSHA
without that question; one that Redis does not hold (after a restart or SCRIPT FLUSH) answers
NOSCRIPT, and only those are loaded and run again, once, in a second round trip. The other
commands of the first pipeline have run by then, so after a restart a record may land before its
refund: nothing reads one as a sign of the other but a test on a Redis that keeps its scripts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError


@dataclass(frozen=True)
class ScriptCall:
    """One run of a registered script: its keys and arguments."""

    script: AsyncScript
    keys: list[str]
    args: list[Any]


async def run_batch(client: aioredis.Redis, scripts: list[ScriptCall],
                    then: Callable[[aioredis.client.Pipeline], None] | None = None) -> list[Any]:
    """Run `scripts` in order, then the commands `then` queues, in one pipeline; the scripts'
    replies, in order. An error reply other than NOSCRIPT is raised, as a pipeline raises it."""
    async with client.pipeline(transaction=False) as pipe:
        for call in scripts:
            pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        if then is not None:
            then(pipe)
        replies = await pipe.execute(raise_on_error=False)
    missing = [index for index, reply in enumerate(replies[:len(scripts)]) if isinstance(reply, NoScriptError)]
    if missing:
        async with client.pipeline(transaction=False) as pipe:
            for script in {id(scripts[index].script): scripts[index].script for index in missing}.values():
                pipe.script_load(script.script)
            for index in missing:
                call = scripts[index]
                pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
            again = await pipe.execute(raise_on_error=False)
        for index, reply in zip(missing, again[len(again) - len(missing):]):
            replies[index] = reply
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies[:len(scripts)]
