"""One streamed completion as bench/serve.py sends it, and what came back: shared by the load
generator's own event loop and its extra load processes (bench/serve_load_processes.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int,
                      run_start: float | None = None, *, url: str = "/v1/completions",
                      fields: dict[str, Any] | None = None) -> Result:
    """One streamed completion to ``url``; ``fields`` replace or add to the body's (the gateway's
    upstream fields, for a worker called straight in --through-gateway)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True, **(fields or {}),
    }
    start = time.perf_counter()
    last = None
    result = Result(ok=False, prompt_tokens=len(prompt))
    # For a failure's message: when the request was written and how far its response got.
    chunks, sent = -1, None

    async def trace(event: str, info: dict) -> None:
        nonlocal sent
        if event == "http11.send_request_body.complete":
            sent = time.perf_counter() - start

    try:
        async with client.stream("POST", url, json=body, extensions={"trace": trace}) as response:
            chunks = 0
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                chunks += 1
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except httpx.HTTPError as exc:
        got = "before the response's headers" if chunks < 0 else f"after {chunks} events"
        began = "" if run_start is None else f", begun {start - run_start:.1f}s into the run"
        wrote = "unsent" if sent is None else f"sent at {sent:.1f}s"
        result.error = f"{exc!r} {got}, {time.perf_counter() - start:.1f}s in ({wrote}){began}"
        return result
    result.e2e = time.perf_counter() - start
    result.ok = last is not None
    return result
