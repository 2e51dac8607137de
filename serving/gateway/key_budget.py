"""An API key's monthly token budget: the month's spend counter in Redis, read before admission.

The usage records are what a key spent; summing them on every request would cost a query over a
month of rows, so each key has a counter per calendar month (UTC), a Redis hash
`loraplex:gateway:key-tokens:<prefix>:<YYYY-MM>` of

- `tokens`: what the counter holds,
- `since`: from when it holds every record (unix seconds),
- `seeded`: "1" once the records before `since` were added.

Every usage record adds its tokens as it is queued (`spend_add`, on the record's own pipeline: no
round trip of its own) and sets `since` to its time if none is set yet. A budgeted key's request
reads the counter first (one script, one round trip; keys without a budget never do); the month's
first read, or the first after Redis lost its data, finds it unseeded and adds the records of the
month before `since` (the catalog sums them from the database) once, so from then on the counter
equals the month's records. A request is refused (429 key_budget_exceeded) once the counter has
reached the budget: requests in flight then still finish, so a month's spend can pass the budget by
what they use.
"""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from serving.gateway.errors import GatewayError
from serving.wire.redis_guard import RedisGuard

KEY_PREFIX = "loraplex:gateway:key-tokens:"
# A counter outlives its month by this much: a record held back while Redis was away may still land
# in it once Redis is back.
KEEP_AFTER_MONTH_S = 7 * 86_400

# KEYS[1]: the counter. ARGV: now, expiry (unix ms). Sets `since` if the counter has none.
# Returns {tokens, since, seeded} as strings.
_READ = """
local v = redis.call('HMGET', KEYS[1], 'tokens', 'since', 'seeded')
local since = v[2]
if not since then
  since = ARGV[1]
  redis.call('HSET', KEYS[1], 'since', since)
  redis.call('PEXPIREAT', KEYS[1], ARGV[2])
end
return {v[1] or '0', since, v[3] or '0'}
"""

# KEYS[1]: the counter. ARGV: the tokens recorded before `since`, expiry (unix ms). Adds them once.
_SEED = """
if redis.call('HGET', KEYS[1], 'seeded') ~= '1' then
  redis.call('HINCRBY', KEYS[1], 'tokens', ARGV[1])
  redis.call('HSET', KEYS[1], 'seeded', '1')
  redis.call('PEXPIREAT', KEYS[1], ARGV[2])
end
return redis.call('HGET', KEYS[1], 'tokens') or '0'
"""


@dataclass(frozen=True)
class Month:
    """A calendar month (UTC): its name, its first second and the first of the next, unix seconds."""

    name: str
    start: float
    end: float

    @classmethod
    def of(cls, at: float) -> Month:
        moment = time.gmtime(at)
        year, month = moment.tm_year, moment.tm_mon
        following = (year + 1, 1) if month == 12 else (year, month + 1)
        return cls(name=f"{year:04d}-{month:02d}", start=float(calendar.timegm((year, month, 1, 0, 0, 0))),
                   end=float(calendar.timegm((*following, 1, 0, 0, 0))))

    def iso_end(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.end))


def counter_key(key_prefix: str, month: Month) -> str:
    return f"{KEY_PREFIX}{key_prefix}:{month.name}"


def _expiry_ms(month: Month) -> int:
    return int((month.end + KEEP_AFTER_MONTH_S) * 1000)


def spend_add(pipe: aioredis.client.Pipeline, key_prefix: str, tokens: int, at: float) -> None:
    """Queue a record's `tokens` on its key's counter for the month of `at` (the caller executes
    the pipeline, with the record's push)."""
    if tokens <= 0:
        return
    month = Month.of(at)
    key = counter_key(key_prefix, month)
    pipe.hincrby(key, "tokens", tokens)
    pipe.hsetnx(key, "since", repr(at))
    pipe.pexpireat(key, _expiry_ms(month))


@dataclass(frozen=True)
class Spend:
    """What a key has spent in `month`, in tokens."""

    tokens: int
    month: Month


# The records of a key in [start, before) (unix seconds), in tokens: the catalog's sum.
RecordedTokens = Callable[[float, float], Awaitable[int]]


class KeyBudgets:
    """The two scripts, bound to one Redis client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._read = client.register_script(_READ)
        self._seed = client.register_script(_SEED)

    async def read(self, key_prefix: str, *, now: float) -> tuple[int, float, bool]:
        """(tokens, since, seeded) of the key's counter for the month of `now`."""
        month = Month.of(now)
        tokens, since, seeded = await self._read(keys=[counter_key(key_prefix, month)],
                                                 args=[repr(now), _expiry_ms(month)])
        return int(tokens), float(since), seeded in (b"1", "1")

    async def seed(self, key_prefix: str, tokens: int, *, now: float) -> int:
        """Add the records before `since` to an unseeded counter (once, whoever calls); its tokens."""
        month = Month.of(now)
        return int(await self._seed(keys=[counter_key(key_prefix, month)], args=[tokens, _expiry_ms(month)]))

    async def spent(self, key_prefix: str, *, now: float, guard: RedisGuard,
                    recorded: RecordedTokens) -> Spend | None:
        """The key's spend this month, seeding its counter from the records first if it needs it;
        None while Redis is away (a budget then fails open, as the buckets do)."""
        month = Month.of(now)
        state = await guard.call("key budget", lambda: self.read(key_prefix, now=now))
        if state is None:
            return None
        tokens, since, seeded = state
        if not seeded:
            before = await recorded(month.start, since)
            seeded_tokens = await guard.call("key budget seed", lambda: self.seed(key_prefix, before, now=now))
            if seeded_tokens is None:
                return None
            tokens = seeded_tokens
        return Spend(tokens=tokens, month=month)


def budget_exceeded(key_prefix: str, budget: int, spend: Spend, *, now: float,
                    headers: dict[str, str]) -> GatewayError:
    """The 429 of a key whose month's spend has reached its budget, retryable when the month ends."""
    wait_s = max(1, math.ceil(spend.month.end - now))
    return GatewayError(
        429, f"This API key (lp-{key_prefix}…) has used {spend.tokens:,} tokens this month, its monthly budget is "
             f"{budget:,}; it resets at {spend.month.iso_end()}. A tenant owner can raise the key's budget, or use "
             "another key.", code="key_budget_exceeded",
        headers={**headers, "retry-after": str(wait_s)})
