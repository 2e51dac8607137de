"""Failed sign-ins, throttled per account and per client address (docs/dashboard.md, "Sign-in throttling").

Each account and each address has a window of LOGIN_FAILURE_WINDOW_SECONDS that opens with its
first attempt. An attempt is counted *before* its password is checked (one atomic increment in
Django's cache, which is Redis here), so parallel guesses cannot all slip past the check; an
attempt past LOGIN_FAILURES_PER_ACCOUNT for its account, or LOGIN_FAILURES_PER_ADDRESS for its
address, in the window is refused without checking the password, the right one included, until
the window ends. A success empties the account's window and takes its attempt back from the
address's, so the counters count failures: an office behind one address is not locked out by its
own successful sign-ins.

Windows end by this module's clock (`clock`), not only by the cache's expiry, so tests move time.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from django.conf import settings
from django.core.cache import cache
from django.http import HttpRequest

log = logging.getLogger(__name__)
clock: Callable[[], float] = time.time

_PREFIX = "login-throttle"
_REFUSAL_ATTR = "_login_throttle_refusal"


@dataclass(frozen=True)
class Refusal:
    """A refused attempt: which limit refused it and how long until its window ends."""

    scope: str  # "account" or "address"
    retry_after: float  # seconds

    @property
    def message(self) -> str:
        minutes = max(1, math.ceil(self.retry_after / 60))
        return f"Too many failed sign-in attempts; try again in {minutes} minute{'' if minutes == 1 else 's'}."


@dataclass(frozen=True)
class _Count:
    key: str  # the counter of the window in force
    start: float  # when that window opened
    attempts: int  # this attempt included


@dataclass(frozen=True)
class Attempt:
    """An admitted attempt's place in its account's and its address's windows."""

    username: str
    address: str
    account: _Count
    by_address: _Count


def _account_base(username: str) -> str:
    return _base("account", username.strip().casefold())


def _base(scope: str, value: str) -> str:
    # Hashed: usernames and IPv6 addresses hold characters some cache backends refuse in keys.
    return f"{_PREFIX}:{scope}:{hashlib.sha256(value.encode()).hexdigest()[:32]}"


def _window_seconds() -> float:
    return float(settings.LOGIN_FAILURE_WINDOW_SECONDS)


def _count(base: str, now: float) -> _Count:
    """Counts one attempt in the window in force for `base`, opening a new one if none is."""
    window = _window_seconds()
    ttl = math.ceil(window)
    start_key = f"{base}:start"
    cache.add(start_key, now, timeout=ttl)  # only the first attempt of a window sets it
    start = float(cache.get(start_key, now))
    if now - start >= window:  # over by our clock though the cache still holds it
        start = now
        cache.set(start_key, start, timeout=ttl)
    # Each window has a counter of its own (named by its start), so a new window starts at zero
    # without a reset that could race with another process's increment.
    key = f"{base}:{start!r}"
    cache.add(key, 0, timeout=ttl)
    try:
        attempts = cache.incr(key)
    except ValueError:  # expired between add and incr
        cache.set(key, 1, timeout=ttl)
        attempts = 1
    return _Count(key=key, start=start, attempts=attempts)


def _uncount(count: _Count) -> None:
    try:
        cache.decr(count.key)
    except ValueError:  # its window has ended meanwhile
        pass


def client_address(request: HttpRequest) -> str:
    """The client's address as the ASGI server reports it: the connection's peer, or the client a
    proxy in TRUSTED_PROXIES names in X-Forwarded-For (uvicorn's --forwarded-allow-ips, set from that
    setting by lora_platform.launcher.web_argv; from anyone else the header is ignored)."""
    return str(request.META.get("REMOTE_ADDR") or "unknown")


def admit(request: HttpRequest, username: str) -> Attempt | Refusal:
    """Counts a sign-in attempt; the Attempt to report the outcome of, or the Refusal to answer with."""
    now, address = clock(), client_address(request)
    account = _count(_account_base(username), now)
    limit = settings.LOGIN_FAILURES_PER_ACCOUNT
    if account.attempts > limit:
        return _refused(request, Refusal("account", account.start + _window_seconds() - now), username, address,
                        first=account.attempts == limit + 1)
    by_address = _count(_base("address", address), now)
    limit = settings.LOGIN_FAILURES_PER_ADDRESS
    if by_address.attempts > limit:
        _uncount(account)  # not checked, so not one of the account's failures
        return _refused(request, Refusal("address", by_address.start + _window_seconds() - now), username, address,
                        first=by_address.attempts == limit + 1)
    return Attempt(username=username, address=address, account=account, by_address=by_address)


def _refused(request: HttpRequest, refusal: Refusal, username: str, address: str, *, first: bool) -> Refusal:
    setattr(request, _REFUSAL_ATTR, refusal)
    # One line when a window first refuses, at WARNING; the refusals after it at INFO, so a flood of
    # guesses does not flood the warnings.
    log.log(logging.WARNING if first else logging.INFO,
            "sign-in refused for %r from %s: too many failures for this %s; %.0f s left in the window",
            username, address, refusal.scope, refusal.retry_after)
    return refusal


def failed(attempt: Attempt) -> None:
    """The attempt's password was wrong (or the account cannot log in): it stays counted."""
    log.info("sign-in failed for %r from %s (%d of %d for the account in the window)", attempt.username,
             attempt.address, attempt.account.attempts, settings.LOGIN_FAILURES_PER_ACCOUNT)


def succeeded(attempt: Attempt) -> None:
    """The account's window is emptied; the address gets this attempt back."""
    cache.delete_many([f"{_account_base(attempt.username)}:start", attempt.account.key])
    _uncount(attempt.by_address)


def refusal_of(request: HttpRequest) -> Refusal | None:
    """The refusal this request's sign-in got, for the form to say why."""
    refusal = getattr(request, _REFUSAL_ATTR, None)
    return refusal if isinstance(refusal, Refusal) else None


# What the cache raises when Redis is down or frozen: the throttle then stands aside (logged), so
# an outage of Redis does not lock everyone out of the dashboard and the admin.
CACHE_ERRORS = (redis.RedisError, OSError)
