-- Shared heartbeats: when each replica last wrote the arrivals it saw, and how often it writes them
-- (its heartbeat check). A replica declares a worker silent only as of the earliest write of the
-- other live replicas: one whose check runs late has not published its latest arrivals yet
-- (api/job_sync.py); one that missed three checks is taken for dead.
CREATE TABLE replica_sync (
    replica TEXT PRIMARY KEY, synced_at DOUBLE PRECISION NOT NULL, check_s DOUBLE PRECISION NOT NULL);
