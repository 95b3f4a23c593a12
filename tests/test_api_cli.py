"""The serve command: refuses to start without a controller token; serves with one."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

from api.cli import add_serve_parser

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(60)


def test_serve_refuses_without_token(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "--data-dir", str(tmp_path), "--port", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "RECYCLE_CONTROLLER_TOKEN" in r.stderr


def test_serve_parser_flags() -> None:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["serve", "--host", "0.0.0.0", "--port", "9", "--data-dir", "d", "--insecure-dev"]
    )
    assert (args.host, args.port, args.data_dir, args.insecure_dev) == ("0.0.0.0", 9, "d", True)
    assert args.func.__name__ == "cmd_serve"
