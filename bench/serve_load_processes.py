"""A run's measured requests sent from several processes (bench/serve.py --load-processes).

One Python event loop reads about 10,000 streamed chunks a second (httpx's line reader and a JSON
parse per chunk): past ~80 req/s of 128-token streams the load generator, not the worker, sets
the pace, and its lag shows up as TTFT and TPOT. vLLM's benchmark_serving has the same ceiling.
Here the requests are dealt round robin to K spawned processes, each with its own event loop and
client; every process sends its requests at the same Poisson arrival times, measured from one
wall-clock start, so the offered load is the one a single loop would have offered.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from bench.serve_request import Result, one_request

# How far ahead of its processes' first request a run's start is set: long enough for every
# process to have received its share and opened its event loop.
_LEAD_S = 0.5


@dataclass(frozen=True)
class Share:
    """What one load process sends: its requests (index in the run, model, prompt ids, output
    length, arrival offset in seconds from the run's start) and where, as which caller."""

    requests: list[tuple[int, str, list[int], int, float]]
    base_url: str | None
    headers: dict[str, str]
    urls: list[str]
    fields: dict[str, dict[str, Any]]
    start: float  # time.time() of the run's start
    deadline: float  # time.time() past which nothing is sent and nothing more is awaited


def deal(requests: list[tuple[str, list[int], int]], offsets: list[float], processes: int) -> list[list[tuple[int, str, list[int], int, float]]]:
    """The requests dealt round robin to ``processes`` shares, each with its index and arrival offset."""
    shares: list[list[tuple[int, str, list[int], int, float]]] = [[] for _ in range(processes)]
    for index, ((model, prompt, output_len), offset) in enumerate(zip(requests, offsets)):
        shares[index % processes].append((index, model, prompt, output_len, offset))
    return shares


def send_share(share: Share) -> tuple[list[tuple[int, Result | None]], float]:
    """In a load process: send the share's requests at their arrival times. Returns each request's
    result (None: not sent, or unfinished at the deadline) and time.time() when the last finished."""
    return asyncio.run(_send(share))


async def _send(share: Share) -> tuple[list[tuple[int, Result | None]], float]:
    # A fresh connection per request, as the single-process path has (bench/serve.py says why).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    client_args: dict[str, Any] = {"base_url": share.base_url} if share.base_url else {}
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=share.headers, **client_args) as client:
        loop = asyncio.get_running_loop()
        # The run's wall-clock start on this loop's clock.
        zero = loop.time() + (share.start - time.time())
        run_start = time.perf_counter() + (share.start - time.time())
        tasks: dict[int, asyncio.Task[Result]] = {}
        for index, model, prompt, output_len, offset in share.requests:
            if share.start + offset >= share.deadline:
                break
            delay = zero + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            url = share.urls[index % len(share.urls)]
            tasks[index] = asyncio.create_task(one_request(client, model, prompt, output_len, run_start, url=url,
                                                           fields=share.fields.get(model)))
        left = None if share.deadline == float("inf") else max(0.0, share.deadline - time.time())
        done, pending = await asyncio.wait(tasks.values(), timeout=left) if tasks else (set(), set())
        finished = time.time()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    results = [(index, task.result() if task in done else None) for index, task in tasks.items()]
    return results, finished


class LoadProcesses:
    """K spawned processes, started once for a whole bench run (a spawn imports httpx anew: about
    a second each), that send each run's requests between them."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        # Spawned, not forked: the parent runs an event loop and may hold a launched worker's pipes.
        self._pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"))
        # Start every process now, not in the first run's window.
        list(self._pool.map(_ready, range(processes)))

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)

    async def run(self, requests: list[tuple[str, list[int], int]], offsets: list[float], *, base_url: str | None,
                  headers: dict[str, str], urls: list[str], fields: dict[str, dict[str, Any]],
                  time_limit: float | None) -> tuple[list[Result | None], float, float]:
        """Send ``requests`` at ``offsets`` (seconds from the start) from the processes. Returns
        each request's result in order (None: cut at ``time_limit`` or never sent), the run's
        duration (start to the last finish) and how many seconds before the start it was set."""
        start = time.time() + _LEAD_S
        deadline = start + (time_limit if time_limit is not None else float("inf"))
        loop = asyncio.get_running_loop()
        futures = [loop.run_in_executor(self._pool, send_share,
                                        Share(share, base_url, headers, urls, fields, start, deadline))
                   for share in deal(requests, offsets, self.processes)]
        results: list[Result | None] = [None] * len(requests)
        last = start
        for share_results, finished in await asyncio.gather(*futures):
            for index, result in share_results:
                results[index] = result
            last = max(last, finished)
        return results, last - start, _LEAD_S


def _ready(_: int) -> bool:
    return True
