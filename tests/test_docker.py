"""docker/: docker cannot run here, so the files are linted (hadolint) and every command they run is
parsed by the project's own argument parsers, so a renamed flag or a missing file shows up here."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from api.cli import add_serve_parser
from runtime_adapter.cli import add_worker_parser

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


def expand(line: str, env: dict[str, str]) -> str:
    """Compose-escaped shell variables ($${X}, $${X:-default}) replaced by `env` values or defaults."""
    return re.sub(r"\$\$\{(\w+)(:-(\w+))?\}", lambda m: env.get(m.group(1), m.group(3) or "x"), line)


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


def test_compose_worker_commands_parse() -> None:
    services = compose()["services"]
    workers = {n: s for n, s in services.items() if n.startswith("worker-")}
    assert len(workers) == 4
    parser = subcommand_parser(add_worker_parser)
    seen = set()
    for name, svc in workers.items():
        script = svc["command"][-1]
        line = script.split("exec ", 1)[1]
        argv = shlex.split(expand(line, svc["environment"]))
        assert argv[:4] == ["python", "-m", "runtime_adapter.cli", "worker"], name
        args = parser.parse_args(argv[3:])
        assert (ROOT / args.job).is_file(), f"{name}: job spec {args.job} is not in the image"
        host = args.store.rsplit(":", 1)[0]
        assert host in services, f"{name}: store host {host} is not a compose service"
        seen.add((args.pipeline, args.stage))
    assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_compose_store_and_register_commands() -> None:
    services = compose()["services"]
    compile(services["store"]["command"][-1], "store", "exec")  # valid Python
    register = services["register"]["command"]
    assert (ROOT / register[1]).is_file() and (ROOT / register[3]).is_file()
