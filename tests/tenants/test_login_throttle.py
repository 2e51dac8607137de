"""Issue 23, item 7: failed sign-ins are throttled per account and per client address.

The attack run made 30 wrong guesses in 18.6 s and then logged in. Here the dashboard's login form
is driven through Django's test client against the configured cache (the embedded or CI Redis); the
throttle's clock is moved forward instead of sleeping through the window. Every test uses accounts
and addresses of its own, so runs against a shared Redis never see each other's counters.
"""

from __future__ import annotations

import logging
import uuid

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from tenants import login_throttle

pytestmark = pytest.mark.django_db
PASSWORD = "correct-horse-battery"
REFUSED = "Too many failed sign-in attempts; try again in"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The throttle's clock, as a cell the test moves forward."""
    now = [login_throttle.clock()]
    monkeypatch.setattr(login_throttle, "clock", lambda: now[0])
    return now


def account() -> str:
    name = f"user-{uuid.uuid4().hex[:10]}"
    get_user_model().objects.create_user(username=name, password=PASSWORD)
    return name


def address() -> str:
    return f"2001:db8::{uuid.uuid4().hex[:4]}:{uuid.uuid4().hex[:4]}"  # the documentation prefix


def log_in(username: str, password: str, *, ip: str) -> tuple[bool, str]:
    """(whether the login succeeded, the page's text)."""
    response = Client(REMOTE_ADDR=ip).post(reverse("dashboard:login"), {"username": username, "password": password})
    return response.status_code == 302, response.content.decode()


def test_five_wrong_passwords_lock_the_account_even_for_the_right_one_until_the_window_ends(clock, caplog) -> None:
    alice, attacker = account(), address()
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        ok, page = log_in(alice, "guess", ip=attacker)
        assert not ok and "did not match" in page
    with caplog.at_level(logging.WARNING, logger="tenants.login_throttle"):
        ok, page = log_in(alice, PASSWORD, ip=attacker)
    assert not ok and f"{REFUSED} 15 minutes." in page
    assert any("sign-in refused" in record.getMessage() and alice in record.getMessage() for record in caplog.records)
    # The lock is the account's: the right password from another address is refused too.
    ok, page = log_in(alice, PASSWORD, ip=address())
    assert not ok and REFUSED in page

    # Another account from another address is unaffected.
    assert log_in(account(), PASSWORD, ip=address())[0]

    clock[0] += 10 * 60
    ok, page = log_in(alice, PASSWORD, ip=attacker)
    assert not ok and f"{REFUSED} 5 minutes." in page
    clock[0] += 5 * 60
    assert log_in(alice, PASSWORD, ip=attacker)[0]


def test_a_success_resets_the_accounts_counter(clock) -> None:
    bob, ip = account(), address()
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT - 1):
        assert not log_in(bob, "guess", ip=ip)[0]
    assert log_in(bob, PASSWORD, ip=ip)[0]
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT - 1):
        assert not log_in(bob, "guess", ip=ip)[0]
    assert log_in(bob, PASSWORD, ip=ip)[0]


def test_twenty_failures_from_one_address_lock_that_address_for_every_account(clock) -> None:
    spray = address()
    # A password spray: a few guesses on each of many accounts, under the per-account limit.
    victims = [account() for _ in range(settings.LOGIN_FAILURES_PER_ADDRESS // 2)]
    for victim in victims:
        for _ in range(2):
            assert not log_in(victim, "Summer2026!", ip=spray)[0]
    fresh = account()
    ok, page = log_in(fresh, PASSWORD, ip=spray)
    assert not ok and f"{REFUSED} 15 minutes." in page
    # The accounts themselves are not locked: from elsewhere they sign in.
    assert log_in(fresh, PASSWORD, ip=address())[0] and log_in(victims[0], PASSWORD, ip=address())[0]
    clock[0] += settings.LOGIN_FAILURE_WINDOW_SECONDS
    assert log_in(fresh, PASSWORD, ip=spray)[0]


def test_successful_sign_ins_from_one_address_never_lock_it(clock) -> None:
    """An office behind one address: every sign-in is counted when it starts, and a success gives it
    back, so more successes than the address's failure limit, all in one window, are all let in;
    its failures still count (a limit's worth of them, on other accounts, then locks it)."""
    office = address()
    staff = [account() for _ in range(3)]
    for turn in range(settings.LOGIN_FAILURES_PER_ADDRESS + 5):
        ok, page = log_in(staff[turn % len(staff)], PASSWORD, ip=office)
        assert ok, f"sign-in {turn + 1} from the office was refused: {page[:200]}"
    for _ in range(settings.LOGIN_FAILURES_PER_ADDRESS):
        assert not log_in(account(), "guess", ip=office)[0]
    ok, page = log_in(staff[0], PASSWORD, ip=office)
    assert not ok and REFUSED in page


def test_the_admin_login_is_throttled_by_the_same_counters(clock) -> None:
    admin_name, ip = account(), address()
    get_user_model().objects.filter(username=admin_name).update(is_staff=True, is_superuser=True)
    for _ in range(settings.LOGIN_FAILURES_PER_ACCOUNT):
        assert not log_in(admin_name, "guess", ip=ip)[0]
    client = Client(REMOTE_ADDR=address())
    response = client.post("/admin/login/", {"username": admin_name, "password": PASSWORD, "next": "/admin/"})
    assert response.status_code == 200  # the form again, not the redirect into the admin
    assert client.get("/admin/").status_code == 302


def test_parallel_guesses_get_no_more_password_checks_than_the_limit(clock) -> None:
    """Attempts are counted before the password is checked: 30 guesses at once get 5 checks."""
    from concurrent.futures import ThreadPoolExecutor

    from django.test import RequestFactory

    target, ip = f"user-{uuid.uuid4().hex[:10]}", address()

    def guess(_: int) -> object:
        return login_throttle.admit(RequestFactory().post("/login/", REMOTE_ADDR=ip), target)

    with ThreadPoolExecutor(max_workers=10) as pool:
        outcomes = list(pool.map(guess, range(30)))
    admitted = [outcome for outcome in outcomes if isinstance(outcome, login_throttle.Attempt)]
    assert len(admitted) == settings.LOGIN_FAILURES_PER_ACCOUNT
    assert all(outcome.scope == "account" for outcome in outcomes if isinstance(outcome, login_throttle.Refusal))
