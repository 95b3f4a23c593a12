"""Persistence: the records and Store protocol (api/records.py), and open_store(), which opens the
back-end the settings name: SQLite in the data directory (api/store_sqlite.py, the embedded default)
or PostgreSQL at RECYCLE_DATABASE_URL / `--database` (api/store_pg.py, for several replicas)."""

from __future__ import annotations

from api.records import (
    EventRecord,
    IdempotencyRecord,
    JobRecord,
    PlanRecord,
    SchemaTooNewError,
    Store,
    StoreUnavailableError,
    VersionConflictError,
    VersionRecord,
)
from api.settings import Settings
from api.store_sqlite import SQLiteStore

__all__ = [
    "EventRecord",
    "IdempotencyRecord",
    "JobRecord",
    "PlanRecord",
    "SQLiteStore",
    "SchemaTooNewError",
    "Store",
    "StoreUnavailableError",
    "VersionConflictError",
    "VersionRecord",
    "open_store",
]


def open_store(settings: Settings) -> Store:
    """The store the settings name: PostgreSQL when database_url is set, else SQLite in data_dir.

    Raises StoreUnavailableError (cannot connect), SchemaTooNewError, or ValueError (a URL that
    does not parse)."""
    if settings.database_url:
        from api.store_pg import PostgresStore  # psycopg is needed only for PostgreSQL

        return PostgresStore(settings.database_url.get_secret_value(), settings)
    return SQLiteStore(settings.data_dir)
