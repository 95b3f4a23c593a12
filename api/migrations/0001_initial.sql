-- The PostgreSQL schema of recycle's store: the SQLite tables (api/store_sqlite.py) with
-- PostgreSQL types, plus `heartbeats` (the latest poll arrival of each worker seen by any replica).
CREATE TABLE jobs (
    id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL, worker_token_hash TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, state TEXT NOT NULL, max_failures INTEGER NOT NULL,
    heartbeat_enabled BOOLEAN NOT NULL, heartbeat_timeout_s DOUBLE PRECISION, scenario_json TEXT NOT NULL,
    version INTEGER NOT NULL, unrecoverable_stages TEXT NOT NULL,
    precompute_total INTEGER NOT NULL, precompute_done INTEGER NOT NULL,
    done_workers TEXT NOT NULL DEFAULT '[]', restore_policy TEXT NOT NULL DEFAULT 'auto',
    restore TEXT NOT NULL DEFAULT 'null', checkpoints TEXT NOT NULL DEFAULT '{}',
    joined TEXT NOT NULL DEFAULT '{}');
CREATE UNIQUE INDEX jobs_token ON jobs (worker_token_hash);
CREATE TABLE versions (
    job_id TEXT NOT NULL REFERENCES jobs (id), version INTEGER NOT NULL, scenario_json TEXT NOT NULL,
    schedule_json TEXT NOT NULL, source TEXT NOT NULL, iteration_time_ms DOUBLE PRECISION NOT NULL, cause TEXT,
    created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, version));
CREATE TABLE events (
    job_id TEXT NOT NULL REFERENCES jobs (id), event_id TEXT NOT NULL, seq BIGINT NOT NULL,
    body_json TEXT NOT NULL, status_code INTEGER NOT NULL, result_json TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, event_id));
CREATE INDEX events_seq ON events (job_id, seq);
CREATE TABLE plans (
    key TEXT PRIMARY KEY, schedule_json TEXT NOT NULL, source TEXT NOT NULL,
    iteration_time_ms DOUBLE PRECISION NOT NULL);
CREATE TABLE idempotency (
    key_hash TEXT PRIMARY KEY, request_hash TEXT NOT NULL, job_id TEXT NOT NULL, status_code INTEGER NOT NULL,
    response_json TEXT NOT NULL, token_cipher TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL);
CREATE TABLE heartbeats (
    job_id TEXT NOT NULL REFERENCES jobs (id), d INTEGER NOT NULL, s INTEGER NOT NULL,
    seen_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, d, s));
