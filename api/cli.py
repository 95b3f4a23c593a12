"""`recycle serve`: run the planner service with uvicorn.

planner/cli.py hooks this in with add_serve_parser(sub); settings not given as flags come from the
environment (RECYCLE_*), so `RECYCLE_CONTROLLER_TOKEN=... recycle serve --data-dir /var/lib/recycle`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `serve` subcommand to the `recycle` parser's subparsers."""
    s = sub.add_parser("serve", help="run the planner service (FastAPI + uvicorn)")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--data-dir", help="SQLite store directory (default $RECYCLE_DATA_DIR or ./recycle-data)")
    s.add_argument(
        "--insecure-dev",
        action="store_true",
        help="run without a controller token (no auth)",
    )
    s.add_argument("--log-level", default="info", help="uvicorn log level (default info)")
    s.add_argument(
        "--keep-alive",
        type=float,
        default=75.0,
        help="idle keep-alive seconds for polling workers (default 75)",
    )
    s.add_argument(
        "--no-access-log",
        action="store_true",
        help="do not log every request (thousands of polling workers make that the busiest log)",
    )
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    """Start uvicorn on the app; exit code 2 when there is no controller token and no --insecure-dev."""
    import uvicorn

    from api.main import create_app
    from api.settings import Settings

    overrides: dict[str, object] = {}
    if args.data_dir:
        overrides["data_dir"] = Path(args.data_dir)
    if args.insecure_dev:
        overrides["insecure_dev"] = True
    settings = Settings(**overrides)  # type: ignore[arg-type]
    try:
        app = create_app(settings)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings.insecure_dev and settings.controller_token is None:
        print("warning: --insecure-dev: every endpoint is open to anyone who can reach it", file=sys.stderr)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        workers=1,
        timeout_keep_alive=int(args.keep_alive),
        backlog=4096,
        access_log=not args.no_access_log,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m api.cli --port ...`: the serve command on its own (used by tests and docker)."""
    parser = argparse.ArgumentParser(prog="recycle-serve")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
