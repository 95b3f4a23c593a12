"""The PostgreSQL store's start-up on a real server (bench/pg_cluster.py): migrations recorded once,
a schema from a newer recycle refused naming both versions, and `recycle serve --database` with a URL
that does not parse, does not connect or names a too-new schema: one line, exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from api.records import SchemaTooNewError, StoreUnavailableError
from api.settings import Settings
from api.store import open_store
from api.store_migrate import code_schema_version
from bench.pg_cluster import free_port

psycopg = pytest.importorskip("psycopg")
pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent


def _serve(database: str) -> subprocess.CompletedProcess[str]:
    """`recycle serve --database URL` as a process of its own (start-up only: it is expected to fail)."""
    env = dict(
        os.environ, RECYCLE_CONTROLLER_TOKEN="t" * 16, PYTHONPATH=str(ROOT), RECYCLE_DATABASE_TIMEOUT_S="2"
    )
    cmd = [sys.executable, "-m", "api.cli", "--port", "0", "--database", database]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _serve_here(
    database: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> tuple[int, str]:
    """The serve command in this process (cheaper; the start-up checks run before anything starts)."""
    from api.cli import main

    monkeypatch.setenv("RECYCLE_CONTROLLER_TOKEN", "t" * 16)
    monkeypatch.setenv("RECYCLE_DATABASE_TIMEOUT_S", "2")
    code = main(["--port", "0", "--database", database])
    return code, capsys.readouterr().err


def test_migrations_are_recorded_and_applied_once(pg_database: str) -> None:
    settings = Settings(database_url=pg_database)
    open_store(settings).close()
    open_store(settings).close()  # a second replica's start: nothing to apply
    with psycopg.connect(pg_database) as conn:
        rows = conn.execute("SELECT version, name FROM schema_migrations ORDER BY version").fetchall()
    assert [v for v, _ in rows] == list(range(1, code_schema_version() + 1))
    assert rows[0][1] == "0001_initial"


def test_a_schema_from_a_newer_version_is_refused_naming_both_versions(
    pg_database: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(database_url=pg_database)
    open_store(settings).close()
    newer = code_schema_version() + 5
    with psycopg.connect(pg_database) as conn:
        conn.execute("INSERT INTO schema_migrations (version, name) VALUES (%s, 'from_the_future')", (newer,))
    with pytest.raises(SchemaTooNewError, match=f"version {newer}.*knows \\({code_schema_version()}\\)"):
        open_store(settings)
    done = _serve(pg_database)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert (
        line.startswith("error: --database:") and str(newer) in line and f"({code_schema_version()})" in line
    )


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mysql://x@127.0.0.1/db", "must start with postgresql://"),
        ("postgresql://u@h:notaport/db", "port 'notaport' is not 1..65535"),
        ("postgresql://u@h/db?nonsense=1", "does not parse: invalid URI query parameter"),
    ],
)
def test_a_database_url_that_does_not_parse_is_one_line_and_exit_2(
    url: str, words: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, err = _serve_here(url, capsys, monkeypatch)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith("error: --database:") and words in line


def test_a_database_that_does_not_connect_is_one_line_and_exit_2() -> None:
    url = f"postgresql://nobody:secret@127.0.0.1:{free_port()}/none"
    with pytest.raises(StoreUnavailableError, match="cannot connect"):
        open_store(Settings(database_url=url))
    done = _serve(url)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: --database: cannot connect to postgresql://nobody:***@127.0.0.1")
    assert "secret" not in line


def test_the_store_is_unavailable_while_the_server_is_down_then_works_again(pg_server: Any) -> None:
    url = pg_server.create_database("outage_store")
    store = open_store(Settings(database_url=url, database_timeout_s=1))
    try:
        assert store.list_jobs() == []
        pg_server.stop()
        try:
            with pytest.raises(StoreUnavailableError):
                store.list_jobs()
        finally:
            pg_server.start()
        assert store.list_jobs() == []  # the pool reconnected
    finally:
        store.close()


def test_the_postgres_scheme_is_taken_and_a_missing_database_is_one_line_and_exit_2(
    pg_database: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    open_store(Settings(database_url=pg_database.replace("postgresql://", "postgres://", 1))).close()
    code, err = _serve_here(pg_database.rsplit("/", 1)[0] + "/no_such_db", capsys, monkeypatch)
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert (
        line.startswith("error: --database: cannot connect")
        and 'database "no_such_db" does not exist' in line
    )


def test_a_read_only_standby_is_unavailable_not_a_500(pg_database: str) -> None:
    """After a failover the URL may reach a standby, read-only: writes are 503 (retry), never a 500."""
    from api.store import PlanRecord
    from api.store_pg import PostgresStore

    store = PostgresStore(pg_database, Settings())
    try:
        with psycopg.connect(pg_database, autocommit=True) as conn:
            db = conn.info.dbname
            conn.execute(f'ALTER DATABASE "{db}" SET default_transaction_read_only = on')
        store.reset_pool()  # new sessions: read-only
        with pytest.raises(StoreUnavailableError, match="read-only"):
            store.put_plan(PlanRecord("k", "{}", "greedy", 1.0))
        assert store.list_jobs() == []  # reads still work
    finally:
        store.close()
