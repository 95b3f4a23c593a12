"""Versioned schema migrations of the PostgreSQL store: plain ordered SQL files in api/migrations/
(`NNNN_name.sql`), each applied once, in its own transaction, and recorded in `schema_migrations`.

Replicas starting together serialize on an advisory lock, so each file runs once. A database whose
newest applied migration is above every file this code has (a newer recycle migrated it) is refused:
SchemaTooNewError names both versions, and the service does not start.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from api.records import SchemaTooNewError

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
_FILE = re.compile(r"(\d{4})_[a-z0-9_]+\.sql")
MIGRATE_LOCK = 0x72637963  # pg_advisory_xact_lock key of the migration step ("rcyc")


def migration_files() -> list[tuple[int, Path]]:
    """(version, file) of every migration, in order; versions must be 1, 2, 3, ..."""
    found = sorted((int(m.group(1)), p) for p in MIGRATIONS.iterdir() if (m := _FILE.fullmatch(p.name)))
    if [v for v, _ in found] != list(range(1, len(found) + 1)):
        raise RuntimeError(f"{MIGRATIONS}: migrations must be numbered 0001, 0002, ... without gaps")
    return found


def code_schema_version() -> int:
    """The newest schema version this code knows."""
    return len(migration_files())


def migrate(conn: Any) -> tuple[int, int]:
    """Apply the missing migrations on `conn` (a psycopg connection); (version before, version after).

    SchemaTooNewError when the database is at a version this code does not know."""
    files = migration_files()
    known = len(files)
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, "
            "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())"
        )
        row = conn.execute("SELECT coalesce(max(version), 0) FROM schema_migrations").fetchone()
        current = int(row[0])
        if current > known:
            raise SchemaTooNewError(
                f"the database schema is at version {current}, newer than this recycle knows ({known}): "
                "run the newer recycle, or a database of its own"
            )
        for version, path in files[current:]:
            conn.execute(path.read_text().encode())
            conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES (%s, %s)", (version, path.stem)
            )
    return current, known
