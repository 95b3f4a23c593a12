"""`recycle serve`: run the planner service with uvicorn.

recycle_cli (the `recycle` dispatcher) hooks this in with add_serve_parser(sub); settings not given
as flags come from the environment (RECYCLE_*), so
`RECYCLE_CONTROLLER_TOKEN=... recycle serve --data-dir /var/lib/recycle`.

Every flag is checked before anything starts, and the listening socket is bound before the solver
processes are spawned: a bad flag, an unusable data directory, an unknown host or a port in use is a
one-line `error: ...` on stderr and exit code 2, never a traceback or a service on another port.
SIGTERM stops the service like SIGINT (Ctrl+C): gracefully, exit code 0.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import IO, Any

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
EXIT_INPUT = 2


def port_number(text: str) -> int:
    """argparse type: a TCP port 1..65535, or 0 (the system picks a free port; it is printed)."""
    try:
        port = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1..65535, or 0)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1..65535, or 0 for a free port)")
    return port


def host_name(text: str) -> str:
    """argparse type: an IPv4/IPv6 address or a host name (resolved when the socket is bound)."""
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        pass
    if len(text) > 253 or _HOSTNAME.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an IP address nor a host name")
    return text


def keep_alive_seconds(text: str) -> int:
    """argparse type: whole seconds 1..3600 (uvicorn takes an integer)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is not between 1 and 3600 seconds")
    return round(value)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the `serve` subcommand to the `recycle` parser's subparsers."""
    s = sub.add_parser("serve", help="run the planner service (FastAPI + uvicorn)")
    s.add_argument("--host", type=host_name, default="127.0.0.1", help="bind address (default 127.0.0.1)")
    s.add_argument(
        "--port",
        type=port_number,
        default=8000,
        help="port 1..65535 (default 8000); 0 picks a free port and prints it",
    )
    s.add_argument("--data-dir", help="SQLite store directory (default $RECYCLE_DATA_DIR or ./recycle-data)")
    s.add_argument(
        "--database",
        metavar="URL",
        help="postgresql://user:password@host:port/db: store in PostgreSQL instead of --data-dir; several "
        "replicas may serve one database (default $RECYCLE_DATABASE_URL)",
    )
    s.add_argument(
        "--insecure-dev",
        action="store_true",
        help="run without a controller token (no auth)",
    )
    s.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="uvicorn log level (default info)")
    s.add_argument(
        "--keep-alive",
        type=keep_alive_seconds,
        default=75,
        help="idle keep-alive seconds for polling workers, 1..3600 (default 75)",
    )
    s.add_argument(
        "--no-access-log",
        action="store_true",
        help="do not log every request (thousands of polling workers make that the busiest log)",
    )
    s.set_defaults(func=cmd_serve)


def _stop(signum: int, frame: FrameType | None) -> None:
    """SIGTERM handler outside uvicorn's own: stop like Ctrl+C does (uvicorn re-raises the signal it
    caught once it has shut down; with the default action that would end the process by the signal,
    skipping the interpreter's clean-up, which is what left the solver pools' semaphores behind)."""
    raise KeyboardInterrupt


GRACEFUL_S = 10  # at a stop, requests still open after this long are cut (a what-if, a parked poll)


def _server_class(uvicorn: Any) -> Any:
    """uvicorn's Server, telling the service when its shutdown starts (JobService.begin_stop), before
    uvicorn waits for open connections: parked polls end at once and no worker is heartbeat-failed
    while nobody can reach the service."""

    class Server(uvicorn.Server):  # type: ignore[misc, name-defined]
        async def shutdown(self, sockets: Any = None) -> None:
            service = getattr(self.config.app.state, "service", None)
            if service is not None:
                service.begin_stop()
            await super().shutdown(sockets=sockets)

    return Server


def check_dir(path: Path, what: str = "--data-dir") -> str | None:
    """None when `path` is (or can be made) a writable directory, else the reason it is not (`what`:
    where the path came from)."""
    if path.exists() and not path.is_dir():
        return f"{what} {path}: exists and is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{what} {path}: cannot create it ({exc.strerror or exc})"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{what} {path}: not writable"
    return check_sqlite_file(path, what)


LOCK_NAME = "recycle.lock"


def lock_data_dir(path: Path) -> IO[str] | str:
    """An exclusive lock on the data directory, held while the returned file stays open (flock: the
    kernel drops it when the process ends, even by SIGKILL), or why it is taken. Two services on one
    SQLite store each answered from their own memory: the second served stale versions and refused
    every event with a 503 that clients retry forever."""
    import fcntl

    f = open(path / LOCK_NAME, "a+")  # noqa: SIM115 (held open on purpose)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip()
        f.close()
        holder = f" (pid {pid})" if pid else ""
        return f"--data-dir {path}: another recycle serve uses it{holder}; run one per data directory"
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def check_sqlite_file(path: Path, what: str) -> str | None:
    """None when `path` holds no store yet or one SQLite can read, else why not (a corrupt or
    foreign file would otherwise fail in the server's start-up with a traceback)."""
    import sqlite3

    from api.store_sqlite import DB_NAME

    db = path / DB_NAME
    if not db.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            conn.execute("PRAGMA schema_version").fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return f"{what} {path}: {DB_NAME} is not a usable SQLite database ({exc}); move it or use another"
    return None


def check_database(settings: object) -> str | None:
    """None when the database of `settings` (api.settings.Settings with database_url) parses, accepts
    a connection and has a schema this code knows (missing migrations are applied), else why not."""
    from api.records import SchemaTooNewError, StoreUnavailableError
    from api.settings import Settings

    assert isinstance(settings, Settings) and settings.database_url is not None
    try:
        from api.store_pg import PostgresStore
    except ImportError as exc:
        return f"--database needs psycopg (pip install 'recycle[service]'): {exc}"
    try:
        PostgresStore(settings.database_url.get_secret_value(), settings).close()
    except (ValueError, StoreUnavailableError, SchemaTooNewError) as exc:
        return f"--database: {exc}"
    return None


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound before anything else starts); OSError with a readable message."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(4096)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def cmd_serve(args: argparse.Namespace) -> int:
    """Start uvicorn on the app. Exit code 2 for a bad setting (no controller token and no
    --insecure-dev, an unusable data directory or PROMETHEUS_MULTIPROC_DIR, a database URL that does
    not parse or connect or whose schema is newer than this code, a RECYCLE_RAY_ADDRESS without Ray
    or where no Ray driver connects, a host or port that cannot be bound), 0 after a graceful stop
    (SIGINT or SIGTERM), 1 when the application failed to start."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _serve(args)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from api.main import create_app
    from api.settings import Settings
    from planner.errors import InvalidInputError
    from planner.settings import load_settings

    overrides: dict[str, object] = {}
    if args.data_dir:
        overrides["data_dir"] = Path(args.data_dir)
    if args.insecure_dev:
        overrides["insecure_dev"] = True
    if args.database:
        overrides["database_url"] = args.database
    try:
        settings = load_settings(Settings, **overrides)
        settings.check_startable()
    except (InvalidInputError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    from api.metrics import MULTIPROC_ENV, multiproc_dir
    from api.solver_ray import check_ray

    metrics_dir = multiproc_dir()
    for check in (  # in turn: the Ray check connects a driver, only worth it when the rest passed
        lambda: check_database(settings) if settings.database_url else check_dir(settings.data_dir),
        lambda: None if metrics_dir is None else check_dir(Path(metrics_dir), MULTIPROC_ENV),
        check_ray,  # RECYCLE_RAY_ADDRESS: Ray installed, its head reachable, a driver connects
    ):
        problem = check()
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return EXIT_INPUT
    lock = None if settings.database_url else lock_data_dir(settings.data_dir)  # held until return
    if isinstance(lock, str):
        print(f"error: {lock}", file=sys.stderr)
        return EXIT_INPUT
    try:
        sock = bind(args.host, args.port)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    port = int(sock.getsockname()[1])
    if args.port == 0:
        shown = f"[{args.host}]" if ":" in args.host else args.host
        print(f"recycle serve: listening on http://{shown}:{port}", file=sys.stderr, flush=True)
    if settings.insecure_dev and settings.controller_token is None:
        print("warning: --insecure-dev: every endpoint is open to anyone who can reach it", file=sys.stderr)
    config = uvicorn.Config(
        create_app(settings),
        host=args.host,
        port=port,
        log_level=args.log_level,
        timeout_keep_alive=args.keep_alive,
        backlog=4096,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=GRACEFUL_S,
    )
    server = _server_class(uvicorn)(config)
    with sock:
        try:
            server.run(sockets=[sock])
        except SystemExit:  # uvicorn's exit(3) when the lifespan raised (its traceback is logged)
            return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m api.cli --port ...`: the serve command on its own (used by tests and docker)."""
    from planner.cli import parse_args  # refuses `--X=--` as `recycle serve` does

    parser = argparse.ArgumentParser(prog="recycle-serve")
    sub = parser.add_subparsers(dest="command")
    add_serve_parser(sub)
    args = parse_args(parser, ["serve", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
