"""A throw-away PostgreSQL cluster for tests and benchmarks: initdb + pg_ctl on a temporary directory,
listening on a loopback port (and a unix socket in the same directory), trust authentication.

    from bench.pg_cluster import pg_cluster, find_bindir

    with pg_cluster() as pg:          # initdb + start; stopped and deleted on exit
        url = pg.url                  # postgresql://recycle@127.0.0.1:PORT/recycle
        other = pg.create_database("t1")   # a fresh database on the same server, its URL
        pg.stop(); pg.start()         # an outage (same port and data) for recovery tests

The binaries are found through `initdb` on PATH, `pg_config --bindir`, then
/usr/lib/postgresql/*/bin (the newest); `find_bindir()` returns None when there are none (tests skip
with that reason). initdb and postgres refuse to run as root: as root, the cluster runs as the OS
user `postgres` (created with useradd when missing) through `runuser`, and the directory is handed
to that user. Durability is off (fsync, synchronous_commit, full_page_writes): a test cluster, never
data that matters.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

DB_NAME = "recycle"
DB_USER = "recycle"
OS_USER = "postgres"


def find_bindir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres, or None."""
    candidates: list[str] = []
    if initdb := shutil.which("initdb"):
        candidates.append(str(Path(initdb).resolve().parent))
    if shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["pg_config", "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            candidates.append(out.stdout.strip())
    versions = glob.glob("/usr/lib/postgresql/*/bin")
    candidates += sorted(
        versions, key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0, reverse=True
    )
    for cand in candidates:
        if cand and all((Path(cand) / exe).is_file() for exe in ("initdb", "pg_ctl", "postgres")):
            return Path(cand)
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_os_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(OS_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OS_USER],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return pwd.getpwnam(OS_USER)


class PgCluster:
    """One PostgreSQL server on a temporary directory; see the module docstring."""

    def __init__(self, port: int | None = None, max_connections: int = 200) -> None:
        bindir = find_bindir()
        if bindir is None:
            raise RuntimeError("no PostgreSQL binaries (initdb, pg_ctl, postgres) found")
        self.bindir = bindir
        self.port = port or free_port()
        self.max_connections = max_connections
        self.base = Path(tempfile.mkdtemp(prefix="recycle-pg-"))
        self.data = self.base / "data"
        self.log = self.base / "postgres.log"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            user = _ensure_os_user()
            os.chown(self.base, user.pw_uid, user.pw_gid)
            runuser = shutil.which("runuser")
            self._as_user = (
                [runuser, "-u", OS_USER, "--"] if runuser else ["su", OS_USER, "-s", "/bin/sh", "-c"]
            )
        self.running = False

    @property
    def url(self) -> str:
        return self.url_for(DB_NAME)

    def url_for(self, dbname: str) -> str:
        return f"postgresql://{DB_USER}@127.0.0.1:{self.port}/{dbname}"

    def _run(self, args: list[str], timeout: float = 60) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self._as_user and self._as_user[0] == "su":
            cmd = [*self._as_user, " ".join(_quote(a) for a in cmd)]
        else:
            cmd = [*self._as_user, *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.base)
        if proc.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{args[0]} failed ({proc.returncode}): {proc.stderr.strip()}\n{log}")

    def init(self) -> None:
        """initdb the directory, configure it, start the server and create the database `recycle`."""
        self._run(["initdb", "-D", str(self.data), "-U", DB_USER, "--auth=trust", "-E", "UTF8", "--no-sync"])
        conf = {
            "listen_addresses": "'127.0.0.1'",
            "port": str(self.port),
            "unix_socket_directories": f"'{self.base}'",
            "max_connections": str(self.max_connections),
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "shared_buffers": "64MB",
            "log_min_messages": "warning",
        }
        with (self.data / "postgresql.conf").open("a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in conf.items())
        self.start()
        self._psql(f'CREATE DATABASE "{DB_NAME}"', "postgres")

    def start(self) -> None:
        """Start the server (same port and data) and wait until it accepts connections."""
        self._run(
            ["pg_ctl", "start", "-w", "-t", "60", "-D", str(self.data), "-l", str(self.log)], timeout=90
        )
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`fast`: roll back and disconnect every session; `immediate`: like a crash)."""
        if self.running:
            self._run(["pg_ctl", "stop", "-w", "-t", "60", "-m", mode, "-D", str(self.data)], timeout=90)
            self.running = False

    def create_database(self, name: str) -> str:
        """Create database `name` (letters, digits, `_`) on this server; return its URL."""
        if not name.replace("_", "").isalnum():
            raise ValueError(f"database name {name!r}: letters, digits and _ only")
        self._psql(f'CREATE DATABASE "{name}"', "postgres")
        return self.url_for(name)

    def _psql(self, sql: str, dbname: str) -> None:
        import psycopg  # the `service` extra: imported only when a database is created

        deadline = time.monotonic() + 30
        while True:
            try:
                with psycopg.connect(self.url_for(dbname), autocommit=True, connect_timeout=5) as conn:
                    conn.execute(sql.encode())
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PgCluster:
        try:
            self.init()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


def _quote(arg: str) -> str:
    return shlex.quote(arg)


@contextlib.contextmanager
def pg_cluster(port: int | None = None, max_connections: int = 200) -> Iterator[PgCluster]:
    """A started throw-away cluster (its `.url`, `.stop()`, `.start()`); deleted on exit."""
    with PgCluster(port=port, max_connections=max_connections) as pg:
        yield pg


if __name__ == "__main__":
    # `python -m bench.pg_cluster`: start one and keep it until Ctrl+C (manual experiments).
    with pg_cluster() as cluster:
        print(cluster.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
