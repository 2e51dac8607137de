"""Issue 37, item 6: the sign-in throttle's per-address count trusts X-Forwarded-For only from the
proxies in TRUSTED_PROXIES (none by default). uvicorn applies the header, so the web process is
started as `make up` starts it (lora_platform.launcher.web_argv) and spoken to over HTTP; its own
default (trust 127.0.0.1) let 24 wrong sign-ins with a rotating header from this machine through."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from lora_platform import launcher
from runtime.settings import SettingsError, settings_read
from tests.lora_platform.live_web import LiveWeb, web_env

pytestmark = pytest.mark.e2e

# A small limit keeps the sign-ins few: each wrong one costs the web process a PBKDF2 hash (a
# million iterations, about 0.2 s of CPU) until the throttle refuses it. ROTATING is well past it, so
# a peer counted as the rotating addresses (or the addresses as one) shows in either test.
PER_ADDRESS = 3
ROTATING = 3 * PER_ADDRESS
ROOT = Path(__file__).resolve().parents[2]


def test_the_web_command_line_trusts_no_proxy_unless_told():
    argv = launcher.web_argv("127.0.0.1", 8000, trusted_proxies=[])
    assert "--no-proxy-headers" in argv and "--forwarded-allow-ips" not in argv
    argv = launcher.web_argv("127.0.0.1", 8000, trusted_proxies=["10.0.0.0/8", "192.0.2.7"])
    assert argv[argv.index("--forwarded-allow-ips") + 1] == "10.0.0.0/8,192.0.2.7"
    assert "--no-proxy-headers" not in argv


def test_trusted_proxies_is_read_from_the_environment_and_must_be_addresses(monkeypatch):
    monkeypatch.delenv("TRUSTED_PROXIES", raising=False)
    assert settings_read(None).trusted_proxies == []
    monkeypatch.setenv("TRUSTED_PROXIES", "10.0.0.0/8, 192.0.2.7")
    assert settings_read(None).trusted_proxies == ["10.0.0.0/8", "192.0.2.7"]
    monkeypatch.setenv("TRUSTED_PROXIES", "proxy.example")
    with pytest.raises(SettingsError, match="(?i)trusted_proxies"):
        settings_read(None)


def test_compose_and_the_image_trust_no_proxy_unless_told():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["web"]["environment"]
    assert compose["FORWARDED_ALLOW_IPS"] == "${TRUSTED_PROXIES:-}"
    assert 'ENV FORWARDED_ALLOW_IPS=""' in (ROOT / "Dockerfile").read_text().splitlines()


class _ProxiedWeb(LiveWeb):
    def __init__(self, env: dict[str, str], log_path: Path, trusted_proxies: list[str] | None) -> None:
        self.trusted_proxies = trusted_proxies
        super().__init__(env, log_path)

    def command(self) -> list[str]:
        return launcher.web_argv("127.0.0.1", self.port, trusted_proxies=self.trusted_proxies)


@pytest.fixture(scope="module")
def web_env_throttled(django_db_setup, django_db_blocker, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    with django_db_blocker.unblock():
        env = web_env(tmp_path_factory.mktemp("proxies"))
    # The throttle's counts live in Redis for their window (15 minutes): a run of this file within
    # the window of another on the same Redis database would start with its addresses refused.
    import redis

    client = redis.Redis.from_url(env["REDIS_URL"])
    for key in client.scan_iter(match="*login-throttle*"):
        client.delete(key)
    client.close()
    return {**env, "LOGIN_FAILURES_PER_ADDRESS": str(PER_ADDRESS), "LOGIN_FAILURES_PER_ACCOUNT": "100"}


@pytest.fixture
def web_untrusted(web_env_throttled, tmp_path) -> Iterator[LiveWeb]:
    # No TRUSTED_PROXIES in its environment: the launcher's default command line.
    server = _ProxiedWeb({**web_env_throttled, "TRUSTED_PROXIES": ""}, tmp_path / "web.log", None)
    yield server
    server.stop()


@pytest.fixture
def web_trusted(web_env_throttled, tmp_path) -> Iterator[LiveWeb]:
    server = _ProxiedWeb(web_env_throttled, tmp_path / "web.log", ["127.0.0.1/32"])
    yield server
    server.stop()


def _failed_sign_ins(web: LiveWeb, forwarded_for: list[str]) -> list[bool]:
    """One wrong sign-in per address given (as X-Forwarded-For), each for another account; for each,
    whether the throttle refused it."""
    refused = []
    with httpx.Client(base_url=web.url, timeout=60) as client:
        for number, address in enumerate(forwarded_for):
            page = client.get("/login/")
            token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
            assert token, page.text
            response = client.post("/login/", headers={"X-Forwarded-For": address, "Referer": f"{web.url}/login/"},
                                   data={"csrfmiddlewaretoken": token.group(1), "username": f"nobody-{number}",
                                         "password": "wrong-password"})
            assert response.status_code == 200, response.text
            refused.append("Too many failed sign-in attempts" in response.text)
    return refused


@pytest.mark.django_db(transaction=True)
def test_a_rotating_forwarded_for_from_an_untrusted_peer_is_throttled_by_the_peer(web_untrusted):
    # The launcher's default command line: the settings name no proxy.
    assert "--no-proxy-headers" in web_untrusted.command()
    refused = _failed_sign_ins(web_untrusted, [f"203.0.113.{number}" for number in range(ROTATING)])
    # The peer (127.0.0.1) is what counts: past PER_ADDRESS failures, every attempt is refused.
    assert refused[PER_ADDRESS:] == [True] * (ROTATING - PER_ADDRESS), refused


@pytest.mark.django_db(transaction=True)
def test_behind_a_trusted_proxy_each_forwarded_address_is_counted_on_its_own(web_trusted):
    refused = _failed_sign_ins(web_trusted, [f"198.51.100.{number}" for number in range(ROTATING)])
    assert refused == [False] * ROTATING
    refused = _failed_sign_ins(web_trusted, ["192.0.2.99"] * (PER_ADDRESS + 1))
    assert refused == [False] * PER_ADDRESS + [True]
