"""Predicted adapter demand for prewarming (docs/resilience.md, "Predictive prewarm"): an EWMA of
each adapter's request rate and an hour-of-day profile, kept in Redis from the gateway's traffic.

- EWMA: an exponentially decayed request rate with time constant `tau_s` (300 s). Each request
  adds 1/tau to the rate after decaying it by exp(-Δt/tau), so the figure is requests per second
  over roughly the last tau, exact for any spacing of requests and needing no timer.
- Hour-of-day profile: per hour of the day (UTC) a decayed count of each adapter's requests in that
  hour; on the first request of an hour on a new day every count of that hour is multiplied by
  `daily_decay` (0.5) per day passed, so the profile follows shifting habits within days. As a
  rate: count × (1 − daily_decay) / 3600 (the steady state of that geometric sum is one day's
  count divided by (1 − daily_decay)).
- Prediction for the next `lookahead_s` (900 s): a Bayesian (gamma-Poisson) estimate that takes
  the profile's rate for the hour that `now + lookahead_s` falls in as the prior, worth `prior_s`
  (3600 s) of observation, and the EWMA's evidence as the observation: the EWMA times tau is the
  decayed count of recent requests over an exposure of tau, so
  rate = (profile × prior_s + EWMA × tau) / (prior_s + tau). One request (a count of 1) then
  counts for ~1 request an hour, not the 12 an hour the bare EWMA reads for ~12 minutes, so a
  one-off request does not outrank an adapter that is steadily busy at that hour; a burst of many
  requests still does, and an adapter busy every morning is loaded before the morning starts.
  (The previous rule, the larger of the two, let the EWMA of a single request outrank all but the
  hottest entries of the profile at the traffic of bench/prewarm.py, and prewarm lost to plain
  LRU there; docs/benchmarks.md.)

Recording is one Lua script per request (atomic across gateway processes); `top` reads the
figures (one HGETALL per key) and ranks them off the request path. Clocks are injected (`now`),
so a time-compressed day can be replayed (bench/prewarm.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from serving.gateway.redis_batch import ScriptCall
from runtime.env import EnvModel, env

KEY_PREFIX = "loraplex:prewarm:"
EWMA_KEY = KEY_PREFIX + "ewma"  # name → "rate at" (rate per second as of unix time `at`)
HOUR_KEY = KEY_PREFIX + "hour:"  # + hour 0–23: name → decayed count; field "_day": day of the last decay


class PrewarmConfig(EnvModel):
    """The demand model (settings.GATEWAY_PREWARM, from GATEWAY_PREWARM_*)."""

    tau_s: float = env(300.0, "GATEWAY_PREWARM_TAU_SECONDS")
    daily_decay: float = env(0.5, "GATEWAY_PREWARM_DAILY_DECAY")
    lookahead_s: float = env(900.0, "GATEWAY_PREWARM_LOOKAHEAD_SECONDS")
    # How many seconds of observation the hour-of-day profile is worth against the EWMA's recent
    # requests in the prediction (a larger value trusts the profile more).
    prior_s: float = env(3600.0, "GATEWAY_PREWARM_PRIOR_SECONDS")


@dataclass(frozen=True)
class Observed:
    """One adapter's figures, requests per second: its EWMA now, its profile for the coming hour."""

    recent: float = 0.0
    hourly: float = 0.0


# KEYS[1] the EWMA hash, KEYS[2] this hour's hash. ARGV: name, now, tau, day, daily_decay.
_RECORD = """
local name, now, tau = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local day, decay = tonumber(ARGV[4]), tonumber(ARGV[5])
local rate, at = 0, now
local stored = redis.call('HGET', KEYS[1], name)
if stored then
  local sp = string.find(stored, ' ')
  rate, at = tonumber(string.sub(stored, 1, sp - 1)), tonumber(string.sub(stored, sp + 1))
end
if now > at then rate = rate * math.exp(-(now - at) / tau) else now = at end
rate = rate + 1 / tau
redis.call('HSET', KEYS[1], name, string.format('%.17g %.17g', rate, now))
local last = tonumber(redis.call('HGET', KEYS[2], '_day'))
if last and last < day then
  local factor = decay ^ (day - last)
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    if all[i] ~= '_day' then
      local v = tonumber(all[i + 1]) * factor
      if v < 1e-3 then redis.call('HDEL', KEYS[2], all[i]) else
        redis.call('HSET', KEYS[2], all[i], string.format('%.17g', v)) end
    end
  end
end
if not last or last < day then redis.call('HSET', KEYS[2], '_day', day) end
redis.call('HINCRBYFLOAT', KEYS[2], name, 1)
return 1
"""


def hour_of(now: float) -> int:
    return int(now // 3600) % 24


def day_of(now: float) -> int:
    return int(now // 86400)


class DemandModel:
    def __init__(self, redis: aioredis.Redis, config: PrewarmConfig = PrewarmConfig()) -> None:
        self.config = config
        self._redis = redis
        self._record = redis.register_script(_RECORD)

    async def record(self, name: str, now: float) -> None:
        """One request for adapter version `name` at unix time `now`."""
        call = self.record_call(name, now)
        await self._record(keys=call.keys, args=call.args)

    def record_call(self, name: str, now: float) -> ScriptCall:
        """`record` as a script run, for a caller that batches it (serving.gateway.redis_batch)."""
        c = self.config
        return ScriptCall(self._record, [EWMA_KEY, f"{HOUR_KEY}{hour_of(now)}"],
                          [name, repr(now), c.tau_s, day_of(now), c.daily_decay])

    async def observed(self, now: float) -> dict[str, Observed]:
        """Every known adapter's two figures: its EWMA now and its profile's rate for the hour
        the lookahead falls in (per second)."""
        c = self.config
        # The client does not decode responses: fields and values are bytes.
        ewma_raw = cast("dict[bytes, bytes]", await self._redis.hgetall(EWMA_KEY))
        ahead = now + c.lookahead_s
        hour_raw = cast("dict[bytes, bytes]", await self._redis.hgetall(f"{HOUR_KEY}{hour_of(ahead)}"))
        # That hour's counts were last decayed on the day of its last request; as of its latest
        # occurrence before `ahead` (today's if under way, else yesterday's) they are worth less.
        last_day = hour_raw.pop(b"_day", None)
        latest = day_of(ahead) if hour_of(now) == hour_of(ahead) else day_of(ahead) - 1
        decay_days = max(0, latest - int(last_day)) if last_day is not None else 0
        factor = c.daily_decay ** decay_days
        out: dict[str, Observed] = {}
        for field, value in ewma_raw.items():
            rate_text, at_text = value.decode().split(" ")
            rate, at = float(rate_text), float(at_text)
            out[field.decode()] = Observed(recent=rate * math.exp(-max(0.0, now - at) / c.tau_s))
        for field, value in hour_raw.items():
            name = field.decode()
            hourly = float(value) * factor * (1.0 - c.daily_decay) / 3600.0
            out[name] = Observed(recent=out[name].recent if name in out else 0.0, hourly=hourly)
        return out

    async def predicted_rates(self, now: float) -> dict[str, float]:
        """Every known adapter's predicted request rate (per second) over the coming lookahead:
        the posterior mean with the hour's profile as the prior (module docstring)."""
        c = self.config
        return {name: (o.hourly * c.prior_s + o.recent * c.tau_s) / (c.prior_s + c.tau_s)
                for name, o in (await self.observed(now)).items()}

    async def top(self, k: int, now: float) -> list[tuple[str, float]]:
        """The `k` adapters with the highest predicted rate, highest first (ties by name)."""
        rates = await self.predicted_rates(now)
        return sorted(rates.items(), key=lambda item: (-item[1], item[0]))[:k]
