"""docker/: docker cannot run here, so the files are linted (hadolint) and every command they run is
parsed by the project's own argument parsers, so a renamed flag or a missing file shows up here."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from api.cli import add_serve_parser
from runtime_adapter.cli import add_store_parser

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
HADOLINT = shutil.which("hadolint")


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def exec_form(dockerfile: Path, instruction: str) -> list[str]:
    """The JSON (exec) form of the last `instruction` (CMD, ...) of a Dockerfile."""
    lines = [ln for ln in dockerfile.read_text().splitlines() if ln.startswith(instruction + " ")]
    assert lines, f"{dockerfile.name}: no {instruction}"
    return yaml.safe_load(lines[-1][len(instruction) + 1 :])


def subcommand_parser(add: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    sub = parser.add_subparsers(dest="command", required=True)
    add(sub)  # type: ignore[operator]
    return parser


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (dev extra, x86_64 only)")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_clean(dockerfile: Path) -> None:
    assert HADOLINT is not None
    cmd = [HADOLINT, "--no-color", str(dockerfile)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist(dockerfile: Path) -> None:
    for line in dockerfile.read_text().splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"{dockerfile.name}: COPY {src}: no such path"


def test_service_image_command_parses() -> None:
    cmd = exec_form(DOCKER / "service.Dockerfile", "CMD")
    assert cmd[:3] == ["python", "-m", "api.cli"]
    args = subcommand_parser(add_serve_parser).parse_args(["serve", *cmd[3:]])
    assert args.host == "0.0.0.0" and args.data_dir == "/data"


def test_compose_builds_and_volumes_exist() -> None:
    doc = compose()
    for name, svc in doc["services"].items():
        build = svc.get("build")
        if build is not None:
            assert (DOCKER / build["context"] / build["dockerfile"]).is_file(), name
        for vol in svc.get("volumes", []):
            assert vol.split(":")[0] in doc["volumes"], f"{name}: volume {vol} not declared"
        for dep in svc.get("depends_on", {}):
            assert dep in doc["services"], f"{name} depends on unknown service {dep}"


def compose_vars(text: str) -> str:
    """Compose's ${X:-default} interpolation with every variable unset (the defaults)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def test_compose_replicas_share_one_postgres() -> None:
    """Two or more service replicas (the service image), each `recycle serve --database` on the
    compose PostgreSQL service, started once it is healthy, with a health check of their own and
    distinct published ports; register waits for every replica to be healthy."""
    services = compose()["services"]
    pg = services["postgres"]
    assert pg["image"].startswith("postgres:") and "pg_isready" in pg["healthcheck"]["test"]
    env = pg["environment"]
    replicas = {
        n: s
        for n, s in services.items()
        if s.get("build", {}).get("dockerfile") == "docker/service.Dockerfile" and "ports" in s
    }
    assert len(replicas) >= 2, replicas.keys()
    published = [port.split(":")[0] for svc in replicas.values() for port in svc["ports"]]
    assert len(set(published)) == len(published), published
    for name, svc in replicas.items():
        cmd = svc["command"]
        assert cmd[:3] == ["python", "-m", "api.cli"], name
        args = subcommand_parser(add_serve_parser).parse_args(["serve", *cmd[3:]])
        url = urlsplit(compose_vars(args.database))
        assert url.scheme == "postgresql" and url.hostname == "postgres" and url.port == 5432, name
        assert (url.username, url.path) == (env["POSTGRES_USER"], "/" + env["POSTGRES_DB"]), name
        assert url.password == compose_vars(env["POSTGRES_PASSWORD"]), name
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy", name
        assert f"127.0.0.1:{args.port}/readyz" in " ".join(svc["healthcheck"]["test"]), name
        assert svc["ports"][0].endswith(f":{args.port}"), name
        assert "planner" in svc["networks"]["default"]["aliases"], name
        assert services["register"]["depends_on"][name]["condition"] == "service_healthy", name
    assert services["register"]["command"][2] == "http://planner:8000"


# The host containers' `recycle agent` command lines (parsed by the project's parsers, every worker
# of the job on exactly one host, store, service and checkpoint volume): tests/test_deploy.py.


def test_compose_store_and_register_commands() -> None:
    services = compose()["services"]
    store = services["store"]["command"]
    assert store[:4] == ["python", "-m", "runtime_adapter.cli", "store"], store
    args = subcommand_parser(add_store_parser).parse_args(store[3:])
    assert (args.host, args.port) == ("0.0.0.0", 29500)
    register = services["register"]["command"]
    assert (ROOT / register[1]).is_file() and (ROOT / register[3]).is_file()


# What each image lacks: the service image installs `.[service]` (no torch), the worker image
# pydantic, pydantic-settings, httpx and torch with the project itself --no-deps (no OR-Tools,
# matplotlib or FastAPI).
MISSING = {
    "service.Dockerfile": ["torch"],
    "worker.Dockerfile": ["ortools", "matplotlib", "fastapi", "starlette", "uvicorn"],
}

# Run in `python -I -S`: -I ignores PYTHONPATH and the user site and does not put the current or the
# script's directory on sys.path; -S skips `site`, so no .pth file runs, in particular not the
# editable install's finder that maps planner/api/... onto this checkout. The bootstrap then adds
# the venv's site-packages as a plain directory (the third-party packages an image would have),
# puts the image's /app copy first, makes the modules the image lacks unimportable, and checks that
# every project package really comes from that copy before running the commands.
BOOTSTRAP = r"""
import contextlib, importlib.abc, io, json, runpy, sys, sysconfig
app, missing, repo = sys.argv[1], set(sys.argv[2].split(",")), sys.argv[3]

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in missing:
            raise ModuleNotFoundError(f"No module named {name!r} (not in this image)", name=name)
        return None

sys.meta_path.insert(0, Missing())
sys.path.insert(0, app)
sys.path.append(sysconfig.get_paths()["purelib"])
assert not any(p.rstrip("/") == repo for p in sys.path), sys.path
out = {}

def run(module, argv):
    buf = io.StringIO()
    sys.argv = [module, *argv]
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code or 0
        except BaseException as exc:
            import traceback
            traceback.print_exc(file=buf)
            code = f"{type(exc).__name__}: {exc}"
    out[" ".join([module, *argv])] = [code, buf.getvalue()]

run("recycle_cli", ["--help"])
try:
    from recycle_cli import build_parser
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    names = list(sub.choices)
except Exception as exc:
    names = []
    out["build_parser()"] = [f"{type(exc).__name__}: {exc}", ""]
for name in names:
    run("recycle_cli", [name, "--help"])
for module in sys.argv[4:]:
    run(module, ["--help"])
for name, mod in list(sys.modules.items()):
    if name.split(".")[0] in ("planner", "api", "runtime_adapter", "whatif", "bench", "recycle_cli"):
        assert (getattr(mod, "__file__", None) or app).startswith(app), (name, mod.__file__)
print(json.dumps(out))
"""


def image_files(dockerfile: Path, dest: Path) -> None:
    """Copy what `dockerfile`'s COPY lines put in its WORKDIR (/app) from the repository to `dest`."""
    for line in dockerfile.read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        *sources, target = line.split()[1:]
        assert not any(s.startswith("--") for s in sources), f"COPY flags not handled: {line}"
        for src in sources:
            to = dest / target / Path(src).name if target.endswith("/") else dest / target
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, to, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                to.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / src, to)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_cli_runs_from_the_image_files(dockerfile: Path, tmp_path: Path) -> None:
    """`recycle --help`, every subcommand's --help and the image's CMD module's --help, run with only
    the files the Dockerfile copies (see BOOTSTRAP for how the checkout is kept off sys.path) and
    without the packages the image does not install: every parser must build, importing lazily."""
    import json
    import sys

    app = tmp_path / "app"
    image_files(dockerfile, app)
    cmd_module = exec_form(dockerfile, "CMD")[2]
    cmd = [sys.executable, "-I", "-S", "-c", BOOTSTRAP, str(app), ",".join(MISSING[dockerfile.name]),
           str(ROOT), cmd_module]  # fmt: skip
    r = subprocess.run(
        cmd, cwd=app, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=50
    )
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.splitlines()[-1])
    for command, (code, output) in results.items():
        assert code == 0 and "usage:" in output, f"{dockerfile.name}: `{command}` failed:\n{output}"
    assert len(results) >= 8, results.keys()  # recycle, its subcommands, the CMD module


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_compose_files_are_in_the_images(dockerfile: Path, tmp_path: Path) -> None:
    """The job spec the compose workers read and the register step's script are in both images."""
    image_files(dockerfile, tmp_path)
    for path in ("docker/tiny-d2p2.json", "docker/register_job.py", "examples"):
        assert (tmp_path / path).exists(), f"{dockerfile.name}: {path} is not in the image"
