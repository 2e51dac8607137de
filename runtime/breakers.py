"""Circuit breakers per adapter version, shared through Redis by every process that judges a version.

Two kinds of process run this one state machine on the same Redis hash (`KEY_PREFIX` + the
version's qualified name): every gateway process (serving.gateway.resilience counts each call) and
every serving worker (serving.engine.server.slot_guard counts a corrupted GPU slot as one failed
call). So the script, its keys, `Outcome` and the thresholds (`BreakerConfig.from_environ`, the
GATEWAY_BREAKER_* variables both read) live here, in the layer neither side owns.

The semantics are resilience4j's count-based breaker:

- CLOSED: every call is let through and its outcome goes into a window of the last
  `window_size` calls (100). Once the window holds at least `minimum_calls` (50), the breaker
  opens when the failure rate passes `failure_rate_threshold` (30 %) or the slow-call rate passes
  `slow_call_rate_threshold` (a call is slow when it took at least `slow_call_duration_s`).
- OPEN: every call is refused; after `cooldown_s` (30 s) the next caller finds it HALF_OPEN.
- HALF_OPEN: `half_open_calls` (5) trial permits are handed out, the rest refused. All trials
  succeed → CLOSED with an empty window; one fails or is slow → OPEN again for a new cool-down.
  Trials that never report (their gateway process died) would hold the breaker half-open for
  ever, so once `cooldown_s` passes with permits still out, a fresh set of trials is issued.

Each transition bumps the breaker's `epoch`; a permit carries the epoch it was issued in and its
outcome is dropped if the breaker has moved on since (a call let through while CLOSED that ends
after the breaker opened must not count as a half-open trial). Outcomes that say nothing about the
adapter (a client's 4xx, a cancelled request) are IGNORED: they count nowhere and give a
half-open permit back.

Every transition is one Lua script run (`_LUA`), so two gateway processes can never both take the
last trial permit or both close a breaker. The clock is the caller's (`now` is an argument), which
makes the state machine testable under an injected clock and keeps Redis' own clock out of it.

`LocalBreakers` is the same state machine in process memory: what a gateway falls back to while
Redis is unreachable (see `CircuitBreakers`). The two are kept identical by one test suite run
against both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import redis.asyncio as aioredis
from pydantic import model_validator
from redis.commands.core import AsyncScript

from runtime.env import EnvModel, env
from runtime.redis_guard import RedisGuard

log = logging.getLogger(__name__)

KEY_PREFIX = "loraplex:breaker:"


class State(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Outcome(int, Enum):
    """How a call ended, as the breaker counts it (the codes are the Lua script's)."""

    SUCCESS = 0
    FAILURE = 1
    IGNORED = 4


class BreakerConfig(EnvModel):
    """Thresholds (defaults: the design's and resilience4j's). The web process's settings
    (settings.GATEWAY_BREAKERS) and a serving worker reporting a corrupted slot both read them with
    `from_environ`, so the two judge alike."""

    window_size: int = env(100, "GATEWAY_BREAKER_WINDOW")
    minimum_calls: int = env(50, "GATEWAY_BREAKER_MINIMUM_CALLS")
    failure_rate_threshold: float = env(0.30, "GATEWAY_BREAKER_FAILURE_RATE")
    slow_call_rate_threshold: float = env(0.50, "GATEWAY_BREAKER_SLOW_CALL_RATE")
    # A call is slow when the worker's first byte takes at least this long.
    slow_call_duration_s: float = env(30.0, "GATEWAY_BREAKER_SLOW_CALL_SECONDS")
    cooldown_s: float = env(30.0, "GATEWAY_BREAKER_COOLDOWN_SECONDS")
    half_open_calls: int = env(5, "GATEWAY_BREAKER_HALF_OPEN_CALLS")
    # An idle breaker's key expires after this; an expired key reads as a fresh CLOSED breaker.
    idle_ttl_s: int = 86400

    @model_validator(mode="after")
    def _consistent(self) -> BreakerConfig:
        if not 1 <= self.minimum_calls <= self.window_size:
            raise ValueError(f"minimum_calls must be within 1 and window_size ({self.window_size}), "
                             f"got {self.minimum_calls}")
        for name in ("failure_rate_threshold", "slow_call_rate_threshold"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a rate within 0 and 1, got {value}")
        if self.half_open_calls < 1 or self.cooldown_s <= 0 or self.slow_call_duration_s <= 0:
            raise ValueError("half_open_calls must be >= 1, cooldown_s and slow_call_duration_s > 0")
        return self


@dataclass(frozen=True)
class Permit:
    """The answer to "may this call go to that version?"; hand it back to `record`."""

    name: str
    allowed: bool
    state: State
    epoch: int
    # Seconds until a refused call could be let through (0 when allowed).
    retry_after_s: float
    # False when this answer came from the process-local fallback (Redis unreachable).
    shared: bool = True


@dataclass(frozen=True)
class Snapshot:
    """A breaker's state and its window's figures; while it is open, the figures of the window
    (or the half-open trial) that opened it."""

    name: str
    state: State
    epoch: int
    calls: int
    failures: int
    slow_calls: int
    # The state the last call moved the breaker into (None: it stayed where it was).
    transition: State | None = None
    shared: bool = True

    @property
    def failure_rate(self) -> float:
        return self.failures / self.calls if self.calls else 0.0

    @property
    def slow_call_rate(self) -> float:
        return self.slow_calls / self.calls if self.calls else 0.0


# One run's answer, the script's and the local twin's alike: (allowed, state, epoch, retry after in
# seconds, calls, failures, slow calls, the state entered or "").
Verdict = tuple[int, str, int, float, int, int, int, str]

# Window entries, one character per call: bit 0 = failed, bit 1 = slow.
_OK, _FAILED, _SLOW = 0, 1, 2

_LUA = """
local key = KEYS[1]
local op = ARGV[1]
local now = tonumber(ARGV[2])
local window = tonumber(ARGV[3])
local min_calls = tonumber(ARGV[4])
local fail_thr = tonumber(ARGV[5])
local slow_thr = tonumber(ARGV[6])
local cooldown = tonumber(ARGV[7])
local permits = tonumber(ARGV[8])
local ttl = tonumber(ARGV[9])

local h = redis.call('HMGET', key, 'state', 'epoch', 'ring', 'pos', 'failures', 'slows', 'opened_at',
                     'issued', 'succeeded', 'half_at', 'o_calls', 'o_fails', 'o_slows')
local state = h[1] or 'closed'
local epoch = tonumber(h[2]) or 0
local ring = h[3] or ''
local pos = tonumber(h[4]) or 0
local failures = tonumber(h[5]) or 0
local slows = tonumber(h[6]) or 0
local opened_at = tonumber(h[7]) or 0
local issued = tonumber(h[8]) or 0
local succeeded = tonumber(h[9]) or 0
local half_at = tonumber(h[10]) or 0
-- The figures of the window (or trial) that last opened the breaker, reported while it is open.
local o_calls, o_fails, o_slows = tonumber(h[11]) or 0, tonumber(h[12]) or 0, tonumber(h[13]) or 0
local transition = ''
local changed = false
local calls, fails_seen, slows_seen = 0, 0, 0

local function reset_window()
  ring = ''; pos = 0; failures = 0; slows = 0
end
local function enter(to)
  state = to; epoch = epoch + 1; issued = 0; succeeded = 0; transition = to; changed = true
  reset_window()
  if to == 'open' then opened_at = now; o_calls, o_fails, o_slows = calls, fails_seen, slows_seen end
  if to == 'half_open' then half_at = now end
end

if #ring > window then reset_window(); changed = true end
-- Time-driven transitions happen lazily, when a caller looks.
if state == 'open' and now >= opened_at + cooldown then
  enter('half_open')
elseif state == 'half_open' and issued >= permits and now >= half_at + cooldown then
  enter('half_open')
end

local allowed = 0
local retry = 0
calls, fails_seen, slows_seen = #ring, failures, slows

if op == 'acquire' then
  if state == 'closed' then
    allowed = 1
  elseif state == 'open' then
    retry = opened_at + cooldown - now
  elseif issued < permits then
    issued = issued + 1; allowed = 1; changed = true
  else
    retry = math.min(1, cooldown)
  end
elseif op == 'record' then
  local permit_epoch = tonumber(ARGV[10])
  local code = tonumber(ARGV[11])
  if permit_epoch == epoch then
    if code == 4 then
      if state == 'half_open' and issued > 0 then issued = issued - 1; changed = true end
    elseif state == 'closed' then
      local c = tostring(code)
      if #ring < window then
        ring = ring .. c
      else
        local old = tonumber(string.sub(ring, pos + 1, pos + 1))
        if old % 2 == 1 then failures = failures - 1 end
        if old >= 2 then slows = slows - 1 end
        ring = string.sub(ring, 1, pos) .. c .. string.sub(ring, pos + 2)
      end
      pos = (pos + 1) % window
      if code % 2 == 1 then failures = failures + 1 end
      if code >= 2 then slows = slows + 1 end
      changed = true
      calls, fails_seen, slows_seen = #ring, failures, slows
      if #ring >= min_calls and (failures / #ring > fail_thr or slows / #ring > slow_thr) then
        enter('open')
      end
    elseif state == 'half_open' then
      calls, fails_seen, slows_seen = succeeded + 1, code % 2, (code >= 2) and 1 or 0
      if code ~= 0 then
        enter('open')
      else
        succeeded = succeeded + 1; changed = true
        if succeeded >= permits then enter('closed') end
      end
    end
  end
end

if state == 'open' and transition == '' then calls, fails_seen, slows_seen = o_calls, o_fails, o_slows end
if changed and op ~= 'peek' then
  redis.call('HSET', key, 'state', state, 'epoch', epoch, 'ring', ring, 'pos', pos, 'failures', failures,
             'slows', slows, 'opened_at', tostring(opened_at), 'issued', issued, 'succeeded', succeeded,
             'half_at', tostring(half_at), 'o_calls', o_calls, 'o_fails', o_fails, 'o_slows', o_slows)
end
if op ~= 'peek' then redis.call('EXPIRE', key, ttl) end
return {allowed, state, epoch, math.ceil(math.max(retry, 0) * 1000), calls, fails_seen, slows_seen, transition}
"""


def _code(outcome: Outcome, duration_s: float, config: BreakerConfig) -> int:
    if outcome is Outcome.IGNORED:
        return int(Outcome.IGNORED)
    slow = _SLOW if duration_s >= config.slow_call_duration_s else 0
    return (_FAILED if outcome is Outcome.FAILURE else _OK) | slow


@dataclass
class _LocalState:
    state: str = "closed"
    epoch: int = 0
    ring: list[int] = field(default_factory=list)
    pos: int = 0
    opened_at: float = 0.0
    issued: int = 0
    succeeded: int = 0
    half_at: float = 0.0
    opened_with: tuple[int, int, int] = (0, 0, 0)


class LocalBreakers:
    """The same state machine as `_LUA`, in this process only (the Redis-outage fallback).

    Kept line for line with the script, so both answer every sequence of calls alike.
    """

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self._states: dict[str, _LocalState] = {}

    def run(self, name: str, op: str, now: float, epoch: int = 0, code: int = 0) -> Verdict:
        c = self.config
        s = self._states.setdefault(name, _LocalState())
        transition = ""
        calls = fails_seen = slows_seen = 0

        def enter(to: str) -> None:
            nonlocal transition
            s.state, s.epoch, s.issued, s.succeeded, transition = to, s.epoch + 1, 0, 0, to
            s.ring, s.pos = [], 0
            if to == "open":
                s.opened_at = now
                s.opened_with = (calls, fails_seen, slows_seen)
            if to == "half_open":
                s.half_at = now

        if len(s.ring) > c.window_size:
            s.ring, s.pos = [], 0
        if s.state == "open" and now >= s.opened_at + c.cooldown_s:
            enter("half_open")
        elif s.state == "half_open" and s.issued >= c.half_open_calls and now >= s.half_at + c.cooldown_s:
            enter("half_open")

        def figures() -> tuple[int, int, int]:
            return len(s.ring), sum(x & _FAILED for x in s.ring), sum(1 for x in s.ring if x & _SLOW)

        allowed, retry = 0, 0.0
        calls, fails_seen, slows_seen = figures()
        if op == "acquire":
            if s.state == "closed":
                allowed = 1
            elif s.state == "open":
                retry = s.opened_at + c.cooldown_s - now
            elif s.issued < c.half_open_calls:
                s.issued += 1
                allowed = 1
            else:
                retry = min(1.0, c.cooldown_s)
        elif op == "record" and epoch == s.epoch:
            if code == Outcome.IGNORED:
                if s.state == "half_open" and s.issued > 0:
                    s.issued -= 1
            elif s.state == "closed":
                if len(s.ring) < c.window_size:
                    s.ring.append(code)
                else:
                    s.ring[s.pos] = code
                s.pos = (s.pos + 1) % c.window_size
                calls, fails_seen, slows_seen = figures()
                if calls >= c.minimum_calls and (fails_seen / calls > c.failure_rate_threshold
                                                 or slows_seen / calls > c.slow_call_rate_threshold):
                    enter("open")
            elif s.state == "half_open":
                calls, fails_seen, slows_seen = s.succeeded + 1, code & _FAILED, 1 if code & _SLOW else 0
                if code != 0:
                    enter("open")
                else:
                    s.succeeded += 1
                    if s.succeeded >= c.half_open_calls:
                        enter("closed")
        if s.state == "open" and not transition:
            calls, fails_seen, slows_seen = s.opened_with
        return allowed, s.state, s.epoch, max(retry, 0.0), calls, fails_seen, slows_seen, transition


class CircuitBreakers:
    """Every gateway process's breakers: shared in Redis, process-local while Redis is away.

    Fails open: while Redis cannot be reached (see RedisGuard) each process judges versions by its
    own traffic with the same thresholds, because refusing every adapter's traffic for want of a
    shared counter would turn a Redis outage into a full outage. When Redis answers again the
    shared state (as it was before the outage) is used again; outcomes of permits handed out
    locally are recorded locally.
    """

    def __init__(self, redis: aioredis.Redis, config: BreakerConfig, *, guard: RedisGuard,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._redis = redis
        self._guard = guard
        self._clock = clock
        self._script = redis.register_script(_LUA)
        self.local = LocalBreakers(config)

    async def acquire(self, name: str) -> Permit:
        """Whether a call to version `name` (`tenant/adapter@version`) may go out now."""
        result, shared = await self._run(name, "acquire")
        return self.permit(name, result, shared=shared)

    @staticmethod
    def permit(name: str, result: Verdict, *, shared: bool) -> Permit:
        """The permit an acquire's verdict (`verdict` of the script's reply, or the local run's) gives."""
        allowed, state, epoch, retry_s = result[:4]
        return Permit(name=name, allowed=bool(allowed), state=State(state), epoch=epoch,
                      retry_after_s=retry_s, shared=shared)

    async def record(self, permit: Permit, outcome: Outcome, duration_s: float) -> Snapshot:
        """Counts the call's outcome; the snapshot says whether it moved the breaker."""
        code = self.code(outcome, duration_s)
        result, shared = await self._run(permit.name, "record", permit.epoch, code, local_only=not permit.shared)
        return self._snapshot(permit.name, result, shared)

    def code(self, outcome: Outcome, duration_s: float) -> int:
        """The script's code for an outcome that took `duration_s`."""
        return _code(outcome, duration_s, self.config)

    @property
    def script(self) -> AsyncScript:
        """The registered script, for a caller that batches a run of it with other commands
        (`script_args` gives the run's keys and arguments, `verdict` reads its reply)."""
        return self._script

    def script_args(self, name: str, op: str, epoch: int = 0, code: int = 0) -> tuple[list[str], list[Any]]:
        """The keys and arguments of one run of the script on `name` at this moment."""
        c = self.config
        return [KEY_PREFIX + name], [op, repr(self._clock()), c.window_size, c.minimum_calls, c.failure_rate_threshold,
                                     c.slow_call_rate_threshold, c.cooldown_s, c.half_open_calls, c.idle_ttl_s,
                                     epoch, code]

    def run_local(self, name: str, op: str, epoch: int = 0, code: int = 0) -> Verdict:
        """One op on this process's own breakers (Redis away, or a permit handed out locally)."""
        return self.local.run(name, op, self._clock(), epoch, code)

    @staticmethod
    def verdict(reply: list[Any]) -> Verdict:
        """The script's reply as a verdict."""
        allowed, state, epoch, retry_ms, calls, failures, slows, transition = reply
        return (int(allowed), _text(state), int(epoch), int(retry_ms) / 1000.0, int(calls), int(failures),
                int(slows), _text(transition))

    async def snapshot(self, name: str) -> Snapshot:
        """The breaker's current state and window figures, changing nothing."""
        result, shared = await self._run(name, "peek")
        return self._snapshot(name, result, shared)

    @staticmethod
    def snapshot_of(name: str, result: Verdict, *, shared: bool) -> Snapshot:
        """The snapshot a record's or a peek's verdict gives."""
        return CircuitBreakers._snapshot(name, result, shared)

    @staticmethod
    def _snapshot(name: str, result: Verdict, shared: bool) -> Snapshot:
        _, state, epoch, _, calls, failures, slows, transition = result
        return Snapshot(name=name, state=State(state), epoch=epoch, calls=calls, failures=failures,
                        slow_calls=slows, transition=State(transition) if transition else None, shared=shared)

    async def _run(self, name: str, op: str, epoch: int = 0, code: int = 0, *,
                   local_only: bool = False) -> tuple[Verdict, bool]:
        if not local_only:
            keys, args = self.script_args(name, op, epoch, code)
            reply = await self._guard.call(f"breaker {op}", lambda: self._script(keys=keys, args=args))
            if reply is not None:
                return self.verdict(reply), True
        return self.run_local(name, op, epoch, code), False


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
