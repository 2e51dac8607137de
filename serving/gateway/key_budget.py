"""An API key's monthly token budget: the month's spend counter in Redis, with the tokens of the
requests in flight reserved against it before they are admitted and settled when they end.

The usage records are what a key spent; summing them on every request would cost a query over a
month of rows, so each key has a counter per calendar month (UTC), a Redis hash
`loraplex:gateway:key-tokens:<prefix>:<YYYY-MM>` of

- `tokens`: what the counter holds (the month's usage records),
- `since`: from when it holds every record (unix seconds),
- `seeded`: "1" once the records before `since` were added,
- `reserved`: the tokens reserved by the key's requests in flight,

and beside it a sorted set `<counter>:reserved` of those reservations (`<request id>:<tokens>`,
scored by the time they lapse).

Every usage record adds its tokens as it is queued (`spend_add`, on the record's own pipeline: no
round trip of its own) and sets `since` to its time if none is set yet. A budgeted key's request
reserves the most tokens it can be charged (serving.gateway.accounting.most_tokens) in one script:
admitted only while `tokens + reserved` is below the budget, and
then `reserved` grows by the request's share before any other request is judged. The request's end
(whatever ended it: the reply, the client leaving, the worker failing) releases the reservation
in the same round trip that adds its usage record's tokens, the release after the add, so no
admission ever sees neither. Concurrent requests therefore see each other: the month's spend
passes the budget by at most one request's reservation (the last one admitted below it), however
many arrive at once (issue 37: 200 concurrent requests on a 250-token budget had used 4,390).

A reservation whose release never comes (its gateway process died) lapses after RESERVATION_HOLD_S;
a release after that changes nothing (its tokens still count through the usage record). A usage
record Redis did not take (serving.gateway.usage_backlog) keeps its reservation with it: the two
land in the same later round trip, so the tokens stay held until they are spent.

The month's first reservation, or the first after Redis lost its data, finds the counter unseeded
and adds the records of the month before `since` (the catalog sums them from the database) once,
so from then on the counter equals the month's records. While Redis is away (or answers too slowly
for runtime.redis_guard's bound, as on an overloaded host) a budgeted key is refused with a 503
(`budget_unavailable`): the buckets fail open, but a budget is a ceiling, and failing open let a
key spend 3.6 × its budget on a loaded machine.
"""

from __future__ import annotations

import calendar
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from serving.gateway.errors import GatewayError
from runtime.redis_guard import RedisGuard

KEY_PREFIX = "loraplex:gateway:key-tokens:"
# A counter outlives its month by this much: a record held back while Redis was away may still land
# in it once Redis is back.
KEEP_AFTER_MONTH_S = 7 * 86_400
# A reservation nobody released lapses this long after it was made: longer than any request the
# gateway relays normally runs (a stream of thousands of tokens under load), short enough that a
# gateway process that died mid-request leaves its keys' budgets whole again within the hour.
RESERVATION_HOLD_S = 3_600.0

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

# KEYS[1]: the counter, KEYS[2]: its reservations. ARGV: now (s), expiry (unix ms), budget, the
# request's tokens, its member, when it lapses (unix ms), now (unix ms). Lapsed reservations are
# dropped first. Returns {verdict, tokens, since, reserved}: verdict 'unseeded' (nothing reserved;
# seed, then ask again), 'refused' (tokens + reserved had reached the budget) or 'reserved';
# tokens and reserved as they were before this request's share.
_RESERVE = """
local v = redis.call('HMGET', KEYS[1], 'tokens', 'since', 'seeded', 'reserved')
local since = v[2]
if not since then
  since = ARGV[1]
  redis.call('HSET', KEYS[1], 'since', since)
  redis.call('PEXPIREAT', KEYS[1], ARGV[2])
end
local tokens = tonumber(v[1] or '0')
if v[3] ~= '1' then return {'unseeded', tokens, since, 0} end
local reserved = tonumber(v[4] or '0')
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[7])
if #lapsed > 0 then
  local freed = 0
  for _, member in ipairs(lapsed) do
    freed = freed + tonumber(string.match(member, ':(%d+)$'))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[7])
  reserved = math.max(0, reserved - freed)
  redis.call('HSET', KEYS[1], 'reserved', reserved)
end
if tokens + reserved >= tonumber(ARGV[3]) then return {'refused', tokens, since, reserved} end
redis.call('HINCRBY', KEYS[1], 'reserved', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[5])
redis.call('PEXPIREAT', KEYS[2], ARGV[2])
return {'reserved', tokens, since, reserved}
"""

# KEYS[1]: the counter, KEYS[2]: its reservations. ARGV: the member, its tokens. Only a reservation
# still held is taken off `reserved` (a lapsed one was taken off when it lapsed).
_RELEASE = """
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  if redis.call('HINCRBY', KEYS[1], 'reserved', -tonumber(ARGV[2])) < 0 then
    redis.call('HSET', KEYS[1], 'reserved', 0)
  end
end
return 1
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


def reservations_key(counter: str) -> str:
    return f"{counter}:reserved"


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
    """What a key has spent in `month`, in tokens, and what its requests in flight hold reserved."""

    tokens: int
    month: Month
    reserved: int = 0


@dataclass(frozen=True)
class Reservation:
    """A request's tokens held against its key's budget until `release` (or RESERVATION_HOLD_S)."""

    counter: str
    member: str
    tokens: int


@dataclass(frozen=True)
class BudgetVerdict:
    """A reservation's answer: `reservation` when the request is admitted, None when refused."""

    spend: Spend
    reservation: Reservation | None


# The records of a key in [start, before) (unix seconds), in tokens: the catalog's sum.
RecordedTokens = Callable[[float, float], Awaitable[int]]


class KeyBudgets:
    """The scripts, bound to one Redis client."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client
        self._read = client.register_script(_READ)
        self._seed = client.register_script(_SEED)
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)

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

    async def _reserve_once(self, counter: str, month: Month, budget: int, tokens: int, member: str,
                            now: float) -> tuple[str, int, float, int]:
        verdict, spent, since, reserved = await self._reserve(
            keys=[counter, reservations_key(counter)],
            args=[repr(now), _expiry_ms(month), budget, tokens, member,
                  int((now + RESERVATION_HOLD_S) * 1000), int(now * 1000)])
        return (verdict.decode() if isinstance(verdict, bytes) else verdict), int(spent), float(since), int(reserved)

    async def reserve(self, key_prefix: str, budget: int, tokens: int, *, now: float, guard: RedisGuard,
                      recorded: RecordedTokens) -> BudgetVerdict | None:
        """Reserve `tokens` (at least 1) of the key's month against `budget`, atomically with every
        other request's: admitted while the month's spend plus what is reserved is below the budget.
        Seeds the counter from the records first if it needs it. None while Redis is away (the
        budget fails open, as the buckets do)."""
        month = Month.of(now)
        counter = counter_key(key_prefix, month)
        tokens = max(1, tokens)
        # A member of its own, not the request's id: a caller may repeat X-Request-ID.
        member = f"{uuid.uuid4().hex}:{tokens}"
        state = await guard.call("key budget", lambda: self._reserve_once(counter, month, budget, tokens, member,
                                                                           now))
        if state is None:
            return None
        if state[0] == "unseeded":
            before = await recorded(month.start, state[2])
            if await guard.call("key budget seed", lambda: self.seed(key_prefix, before, now=now)) is None:
                return None
            state = await guard.call("key budget", lambda: self._reserve_once(counter, month, budget, tokens,
                                                                               member, now))
            if state is None:
                return None
        verdict, spent, _, reserved = state
        spend = Spend(tokens=spent, month=month, reserved=reserved)
        if verdict != "reserved":
            return BudgetVerdict(spend=spend, reservation=None)
        return BudgetVerdict(spend=spend, reservation=Reservation(counter=counter, member=member, tokens=tokens))

    async def release(self, reservation: Reservation) -> None:
        """Release `reservation` now (a request that ended before it reached a worker)."""
        await self._release(keys=[reservation.counter, reservations_key(reservation.counter)],
                            args=[reservation.member, reservation.tokens])


def queue_release(pipe: aioredis.client.Pipeline, reservation: Reservation) -> None:
    """Queue the release of `reservation` on a pipeline the caller executes: after the usage
    record's `spend_add`, so that the request's tokens are never counted neither way. EVAL with
    the script's text, not EVALSHA: a pipeline's commands have no NOSCRIPT retry
    (serving.gateway.redis_batch)."""
    pipe.eval(_RELEASE, 2, reservation.counter, reservations_key(reservation.counter), reservation.member,
              reservation.tokens)


def budget_unavailable(key_prefix: str, *, retry_after_s: float, headers: dict[str, str]) -> GatewayError:
    """The 503 of a budgeted key while its spend cannot be read (Redis away, or too slow to answer
    within the guard's bound): a budget is a ceiling its owner set, so it fails closed."""
    return GatewayError(
        503, f"This API key (lp-{key_prefix}…) has a monthly token budget, and its spend cannot be checked right now "
             "(the platform's shared state is unavailable); nothing was charged. Retry shortly, or use a key without "
             "a budget.",
        code="key_budget_unavailable", headers={**headers, "retry-after": str(max(1, math.ceil(retry_after_s)))})


def budget_exceeded(key_prefix: str, budget: int, spend: Spend, *, now: float,
                    headers: dict[str, str]) -> GatewayError:
    """The 429 of a key whose month's spend, with what its requests in flight reserved, has reached
    its budget: retryable when the month ends, or in a second when only the reservations stand in
    the way (they come back as their requests end)."""
    if spend.tokens >= budget:
        wait_s = max(1, math.ceil(spend.month.end - now))
        then = f"it resets at {spend.month.iso_end()}"
    else:
        wait_s = 1
        then = (f"{spend.reserved:,} more are reserved by its requests in flight, and what they do not use comes "
                "back as they end: retry then")
    return GatewayError(
        429, f"This API key (lp-{key_prefix}…) has used {spend.tokens:,} tokens this month, its monthly budget is "
             f"{budget:,}; {then}. A tenant owner can raise the key's budget, or use another key.",
        code="key_budget_exceeded", headers={**headers, "retry-after": str(wait_s)})
