"""Issue 37, item 4: the worker's usage counts every token it generated. `best_of=8, n=1,
max_tokens=8` generates 64 tokens and returns 8; its usage said 8, so the gateway, which charges
the worker's usage, charged an eighth of the work."""

from __future__ import annotations

import openai

from tests.engine.server.conftest import WorkerProcess

BASE = "tiny-base"


def test_best_of_usage_counts_the_discarded_sequences(worker: WorkerProcess) -> None:
    api = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="unused", max_retries=0)
    best = api.completions.create(model=BASE, prompt="The quick brown fox", max_tokens=8, temperature=1.0, seed=5,
                                  n=1, best_of=8, extra_body={"ignore_eos": True})
    assert len(best.choices) == 1
    assert best.usage.completion_tokens == 8 * 8
    assert best.usage.total_tokens == best.usage.prompt_tokens + 64
    api.close()
