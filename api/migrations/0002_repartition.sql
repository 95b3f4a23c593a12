-- Issue 12: a job may plan with re-partition (POST /v1/jobs `repartition`); jobs from before plan
-- re-route only, as they were registered.
ALTER TABLE jobs ADD COLUMN repartition BOOLEAN NOT NULL DEFAULT false;
