"""The authentication backend: Django's ModelBackend behind the sign-in throttle.

It is the one place every password sign-in passes (the dashboard's login and the admin's alike),
so both share the counters of tenants.login_throttle.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.models import User
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

from tenants import login_throttle


class ThrottledModelBackend(ModelBackend):
    def authenticate(self, request: HttpRequest | None, username: str | None = None, password: str | None = None,
                     **kwargs: Any) -> User | None:
        if request is None or username is None or password is None:
            # Not a sign-in over HTTP (a management command, a test's force_login): nothing to throttle.
            return super().authenticate(request, username=username, password=password, **kwargs)
        try:
            attempt = login_throttle.admit(request, username)
        except login_throttle.CACHE_ERRORS:
            login_throttle.log.exception("sign-in throttle unavailable (the cache failed); checking the password "
                                         "without it")
            return super().authenticate(request, username=username, password=password, **kwargs)
        if isinstance(attempt, login_throttle.Refusal):
            # Stops authenticate() here: no other backend is asked, and the password is never checked.
            raise PermissionDenied(attempt.message)
        user = super().authenticate(request, username=username, password=password, **kwargs)
        try:
            if user is None:
                login_throttle.failed(attempt)
            else:
                login_throttle.succeeded(attempt)
        except login_throttle.CACHE_ERRORS:
            login_throttle.log.exception("sign-in throttle could not record an outcome (the cache failed)")
        return user
