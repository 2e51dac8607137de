"""Token buckets in Redis: admission against several buckets at once, atomically, and refunds.

Each bucket is a Redis hash `{level, ts}`: `level` tokens as of time `ts`, refilled continuously at
`rate` per second up to `capacity`. One Lua script refills every bucket of a request to the same
`now` and takes the cost from all of them or from none, so admissions from any number of gateway
processes never oversubscribe a bucket. A missing key is a full bucket; keys expire once they would
be full again, so idle tenants cost no memory.

`now` is Redis's own clock (TIME) unless the caller passes one, which tests do to check refill
exactly. Costs and levels are floats: a refill of rpm/60 per second is fractional.

A refund adds unused tokens back (capped at capacity); a negative refund charges what a request
used beyond its reservation, and may take the level below zero, so the next requests wait for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis.asyncio as aioredis

from serving.gateway.redis_batch import ScriptCall

KEY_PREFIX = "loraplex:gateway:bucket:"

# KEYS: the buckets. ARGV[1]: now in seconds ('' for Redis TIME); then per bucket: capacity, rate
# per second, cost. Returns {admitted, now, then per bucket: level after, seconds until it holds
# its cost (0 when it did)} as strings (Lua numbers would be truncated to integers).
_ADMIT = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local n = #KEYS
local levels, caps, rates, costs = {}, {}, {}, {}
local admitted = 1
for i = 1, n do
  local cap = tonumber(ARGV[2 + (i - 1) * 3])
  local rate = tonumber(ARGV[3 + (i - 1) * 3])
  local cost = tonumber(ARGV[4 + (i - 1) * 3])
  local state = redis.call('HMGET', KEYS[i], 'level', 'ts')
  local level = tonumber(state[1])
  local ts = tonumber(state[2])
  if level == nil or ts == nil then
    level = cap
  elseif now > ts then
    level = math.min(cap, level + (now - ts) * rate)
  end
  levels[i], caps[i], rates[i], costs[i] = level, cap, rate, cost
  if level < cost then admitted = 0 end
end
local out = {tostring(admitted), tostring(now)}
for i = 1, n do
  local level = levels[i]
  local wait = 0
  if admitted == 1 then
    level = level - costs[i]
    redis.call('HSET', KEYS[i], 'level', tostring(level), 'ts', tostring(now))
    local full_in = (caps[i] - level) / rates[i]
    redis.call('PEXPIRE', KEYS[i], math.max(1000, math.ceil(full_in * 1000) + 1000))
  elseif level < costs[i] then
    wait = (costs[i] - level) / rates[i]
  end
  out[#out + 1] = tostring(level)
  out[#out + 1] = tostring(wait)
end
return out
"""

# KEYS[1]: the bucket. ARGV: now ('' for TIME), capacity, rate, amount (negative charges).
_REFUND = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local cap = tonumber(ARGV[2])
local rate = tonumber(ARGV[3])
local amount = tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(state[1])
local ts = tonumber(state[2])
if level == nil or ts == nil then
  level = cap
elseif now > ts then
  level = math.min(cap, level + (now - ts) * rate)
end
level = math.min(cap, level + amount)
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.max(1000, math.ceil((cap - level) / rate * 1000) + 1000))
return tostring(level)
"""


@dataclass(frozen=True)
class Bucket:
    """One bucket: its Redis key, capacity and refill rate (tokens per second)."""

    key: str
    capacity: float
    rate: float

    @classmethod
    def per_minute(cls, name: str, per_minute: int, *, burst: float = 2.0) -> Bucket:
        """A bucket refilled at `per_minute`/60 per second, holding `burst` minutes' worth."""
        return cls(key=f"{KEY_PREFIX}{name}", capacity=burst * per_minute, rate=per_minute / 60.0)


@dataclass(frozen=True)
class BucketState:
    bucket: Bucket
    level: float
    # Seconds until this bucket holds the request's cost (0 when it did).
    wait_s: float

    @property
    def remaining(self) -> int:
        return max(0, math.floor(self.level))

    @property
    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's `x-ratelimit-reset-*`)."""
        return max(0.0, (self.bucket.capacity - self.level) / self.bucket.rate)


@dataclass(frozen=True)
class Admission:
    admitted: bool
    states: list[BucketState]

    @property
    def retry_after_s(self) -> float:
        """Seconds until this request would fit every bucket (0 when admitted)."""
        return max((state.wait_s for state in self.states), default=0.0)


class TokenBuckets:
    """The two scripts, bound to one Redis client (redis-py caches them by sha: EVALSHA)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._admit = client.register_script(_ADMIT)
        self._refund = client.register_script(_REFUND)

    async def admit(self, costs: list[tuple[Bucket, float]], *, now: float | None = None) -> Admission:
        """Take each cost from its bucket, all or none."""
        call = self.admit_call(costs, now=now)
        return self.admission(costs, await self._admit(keys=call.keys, args=call.args))

    def admit_call(self, costs: list[tuple[Bucket, float]], *, now: float | None = None) -> ScriptCall:
        """The admission as a script run, for a caller that batches it (serving.gateway.redis_batch)."""
        args: list[str | float] = ["" if now is None else repr(now)]
        for bucket, cost in costs:
            args += [repr(float(bucket.capacity)), repr(float(bucket.rate)), repr(float(cost))]
        return ScriptCall(self._admit, [bucket.key for bucket, _ in costs], args)

    @staticmethod
    def admission(costs: list[tuple[Bucket, float]], reply: list[bytes | str]) -> Admission:
        """What the admit script's reply to `costs` says."""
        values = [float(item) for item in reply]
        states = [
            BucketState(bucket=bucket, level=values[2 + 2 * index], wait_s=values[3 + 2 * index])
            for index, (bucket, _) in enumerate(costs)
        ]
        return Admission(admitted=values[0] == 1.0, states=states)

    async def refund(self, bucket: Bucket, amount: float, *, now: float | None = None) -> float:
        """Give `amount` back to the bucket (negative: charge it); the new level."""
        call = self.refund_call(bucket, amount, now=now)
        return float(await self._refund(keys=call.keys, args=call.args))

    def refund_call(self, bucket: Bucket, amount: float, *, now: float | None = None) -> ScriptCall:
        """The refund as a script run, for a caller that batches it."""
        return ScriptCall(self._refund, [bucket.key], ["" if now is None else repr(now), repr(float(bucket.capacity)),
                                                       repr(float(bucket.rate)), repr(float(amount))])


def format_reset(seconds: float) -> str:
    """A duration as OpenAI's rate-limit headers write it (Go's format): `12ms`, `1s`, `6m0s`."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    milliseconds = round(seconds * 1000)
    hours, rest = divmod(milliseconds, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def ratelimit_headers(requests: BucketState, tokens: BucketState) -> dict[str, str]:
    """OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for a tenant's buckets."""
    return {
        "x-ratelimit-limit-requests": str(round(requests.bucket.capacity)),
        "x-ratelimit-remaining-requests": str(requests.remaining),
        "x-ratelimit-reset-requests": format_reset(requests.reset_s),
        "x-ratelimit-limit-tokens": str(round(tokens.bucket.capacity)),
        "x-ratelimit-remaining-tokens": str(tokens.remaining),
        "x-ratelimit-reset-tokens": format_reset(tokens.reset_s),
    }
