# The planner service: FastAPI + uvicorn + OR-Tools, no torch.
#   docker build -f docker/service.Dockerfile -t recycle-service .
#   docker run -p 8000:8000 -e RECYCLE_CONTROLLER_TOKEN=... -v recycle-data:/data recycle-service
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    RECYCLE_DATA_DIR=/data

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
# Versions are pinned by pyproject.toml's ranges (the project itself is what is installed here).
# hadolint ignore=DL3013
RUN pip install ".[service]" \
    && useradd --system --uid 10001 recycle \
    && mkdir -p /data && chown recycle /data

USER 10001
VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
# RECYCLE_CONTROLLER_TOKEN must be set (the service refuses to start without it).
CMD ["python", "-m", "api.cli", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]
