"""What a call is charged, and the bounds on what it may reserve (issue 37, item 4: accounting that
cannot be outrun). serving.gateway.pipeline calls each at one place: `check_fits` and `most_tokens`
before admission, `charged_tokens` when the call is settled, `release_after` in the settling round
trip.

The reservation a call holds against its tenant's and key's token buckets is the prompt estimate
plus max_tokens for every sequence it generates (prompts × max(n, best_of)); against its key's
monthly budget, the most it can be charged (`most_tokens`). What it is charged when it ends is the
worker's usage, which counts every generated token, best_of's discarded sequences included
(serving.engine.server.generation).
"""

from __future__ import annotations

from collections.abc import Callable

import redis.asyncio as aioredis

from serving.gateway.errors import invalid_request
from serving.gateway.key_budget import Reservation, queue_release
from serving.gateway.proxy import UpstreamResult
from serving.gateway.records import Call
from serving.gateway.request_buckets import RequestBuckets
from serving.gateway.request_fields import requested_max_tokens


def check_fits(call: Call, buckets: RequestBuckets, *, may_degrade: bool) -> None:
    """400 request_too_large for a request that reserves more tokens than one of its token buckets
    can ever hold: a 429 would name a wait after which it still would not fit. The tenant's bucket
    is exempt where the call `may_degrade`: there the base model answers what the quota cannot hold
    (a key's own bucket never degrades: serving.gateway.request_buckets)."""
    for bucket in buckets.tokens:
        if may_degrade and not buckets.limits[bucket.key].own_key:
            continue
        if call.reserved_tokens > bucket.capacity:
            asked = "" if requested_max_tokens(call.body, call.endpoint) is not None else " (the tier's default)"
            each = f" for each of {call.sequences} completions" if call.sequences > 1 else ""
            raise invalid_request(
                f"This request reserves {call.reserved_tokens:,} tokens (about {call.prompt_estimate:,} of prompt and "
                f"max_tokens {call.max_tokens:,}{asked}{each}), more than the {round(bucket.capacity):,} tokens the "
                f"bucket of {buckets.describe_bucket(bucket)} can ever hold, so it could never be admitted. Lower "
                "max_tokens or shorten the prompt.", param="max_tokens", code="request_too_large")


# What a prompt's tokens may add to the bytes of its request (below): the chat template's own tokens
# (role headers, separators, the generation prompt, a default system prompt, the tool preamble). Generous
# for the templates served: Llama 3's is about 5 a message, ChatML's 5, the tiny test model's 14 for
# one message with its BOS and generation prompt.
TEMPLATE_TOKENS = 128
# A completion's prompts have no template: their BOS tokens only (a prompt is at least a byte of the body).
COMPLETION_TOKENS = 8
TEMPLATE_TOKENS_PER_MESSAGE = 16
TEMPLATE_TOKENS_PER_TOOL = 64


def most_tokens(call: Call) -> int:
    """The most tokens `call` can be charged: what its key's budget reserves. The prompt estimate the
    buckets reserve (about four bytes a token, the template's tokens unknown) is a rate's guess,
    and an overrun is charged to the bucket afterwards; a budget is a ceiling, and requests in
    flight together would pass it by every one's error at once (a one-message chat on the test
    model used 24 tokens where 14 were estimated: 200 at once on a 250-token budget used 504). A
    token covers at least one byte of text (byte-level BPE, and SentencePiece with its byte
    fallback), and every text the prompt holds is in the body, so the prompt has at most the
    body's bytes plus the template's own tokens; the completions at most max_tokens each."""
    template = COMPLETION_TOKENS
    if call.endpoint == "chat":
        template = (TEMPLATE_TOKENS + TEMPLATE_TOKENS_PER_MESSAGE * _count(call.body.get("messages"))
                    + TEMPLATE_TOKENS_PER_TOOL * (_count(call.body.get("tools")) + _count(call.body.get("functions"))))
    return max(call.reserved_tokens, call.body_bytes + template + call.max_tokens * call.sequences)


def _count(items: object) -> int:
    return len(items) if isinstance(items, list) else 0


def charged_tokens(call: Call, result: UpstreamResult) -> tuple[int, int]:
    """The (prompt, completion) tokens a call is charged, never fewer than the worker generated:

    - the worker's usage when it came (every generated token, best_of's discarded ones included);
    - a client that left before it (a dropped stream, a whole reply not waited for): its whole
      reservation, the prompt estimate and max_tokens for every sequence. The connection the
      worker would report on is gone, the worker generates until it notices, and what was relayed
      (one chunk may hold several tokens, or none yet) is no bound on it;
    - a stream the worker broke: the prompt estimate and one token per relayed chunk (the
      worker's failure is not charged beyond what reached the client);
    - a worker's refusal or failure before any reply: nothing."""
    if result.usage_known:
        return result.prompt_tokens, result.completion_tokens
    if result.status == "aborted":
        return call.prompt_estimate, call.max_tokens * call.sequences
    if result.http_status == 200:
        return call.prompt_estimate, result.content_chunks
    return 0, 0


def release_after(queue: Callable[[aioredis.client.Pipeline], None],
                  reservations: list[Reservation]) -> Callable[[aioredis.client.Pipeline], None]:
    """`queue` (the usage records and their spend), then the release of the budget reservations
    they settle: after the spend, so no admission sees the calls' tokens neither spent nor reserved."""
    if not reservations:
        return queue

    def both(pipe: aioredis.client.Pipeline) -> None:
        queue(pipe)
        for reservation in reservations:
            queue_release(pipe, reservation)

    return both
