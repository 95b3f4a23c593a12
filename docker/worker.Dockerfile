# A training worker: torch (CPU build is enough for gloo) + the runtime adapter, no OR-Tools.
#   docker build -f docker/worker.Dockerfile -t recycle-worker .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY planner ./planner
COPY api ./api
COPY bench ./bench
COPY runtime_adapter ./runtime_adapter
COPY whatif ./whatif
COPY recycle_cli ./recycle_cli
COPY examples ./examples
# the compose demo's job spec and registration step
COPY docker/tiny-d2p2.json docker/register_job.py ./docker/
# The project itself with --no-deps keeps ortools and matplotlib out: a worker needs only the wire
# schemas (pydantic), the RECYCLE_* settings (pydantic-settings), an HTTP client and torch (keep the
# torch pin equal to pyproject's `worker` extra; on x86_64 Linux PyPI's torch wheel is the CUDA build,
# which NCCL workers on GPUs need).
RUN pip install "pydantic>=2.6,<2.15" "pydantic-settings>=2.2" "httpx>=0.27" "torch==2.13.0" \
    && pip install --no-deps . \
    && useradd --system --uid 10001 recycle

USER 10001
# Run one worker of a job (see `python -m runtime_adapter.cli worker --help`), e.g.
#   python -m runtime_adapter.cli worker --job JOB.json --pipeline 0 --stage 1 --service URL
#       --job-id ID --token WORKER_TOKEN --store HOST:PORT --iterations 100 --out /tmp/out
CMD ["python", "-m", "runtime_adapter.cli", "--help"]
