"""A transactional test's flush that PostgreSQL picks as a deadlock's victim runs again
(tests/conftest.py, `_flush_postgresql_by_delete`), instead of failing the test's teardown."""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import connection

pytestmark = pytest.mark.postgresql


def test_a_flush_chosen_as_a_deadlocks_victim_runs_again_and_empties_the_tables(transactional_db) -> None:
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE flush_first (id int)")
        cursor.execute("CREATE TABLE flush_second (id int)")
        cursor.execute("INSERT INTO flush_first VALUES (1)")
        cursor.execute("INSERT INTO flush_second VALUES (2)")
    settings = connection.settings_dict
    other = psycopg.connect(host=settings["HOST"] or "127.0.0.1", port=settings["PORT"] or 5432,
                            user=settings["USER"], password=settings["PASSWORD"] or None, dbname=settings["NAME"])
    holding = threading.Event()
    failures: list[BaseException] = []

    def writer() -> None:
        """A process's transaction that writes one table, then reads the one the flush locks first.
        Its own deadlock check waits longer than the flush's, so the flush is the victim."""
        try:
            with other.transaction():
                other.execute("SET LOCAL deadlock_timeout = '20s'")
                other.execute("INSERT INTO flush_second VALUES (3)")
                holding.set()
                other.execute("SELECT pg_sleep(0.3)")
                other.execute("SELECT count(*) FROM flush_first").fetchone()
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            failures.append(error)
            holding.set()

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert holding.wait(30)
        with connection.cursor() as cursor:
            cursor.execute("SET deadlock_timeout = '100ms'")
        # The tables locked one by one, as a LOCK TABLE of several does, with time between for the
        # writer to queue behind the first: the flush then waits last, and its check finds the cycle.
        connection.ops.execute_sql_flush([
            "LOCK TABLE flush_first IN ACCESS EXCLUSIVE MODE;", "SELECT pg_sleep(1);",
            "LOCK TABLE flush_second IN ACCESS EXCLUSIVE MODE;", "DELETE FROM flush_first;", "DELETE FROM flush_second;",
        ])
        thread.join(60)
        assert not failures, failures
        with connection.cursor() as cursor:
            cursor.execute("SELECT (SELECT count(*) FROM flush_first), (SELECT count(*) FROM flush_second)")
            assert cursor.fetchone() == (0, 0)  # the writer's row too: the flush ran after it committed
    finally:
        thread.join(60)
        other.close()
        with connection.cursor() as cursor:
            cursor.execute("RESET deadlock_timeout")
            cursor.execute("DROP TABLE flush_first, flush_second")
