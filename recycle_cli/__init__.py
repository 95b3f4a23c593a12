"""`recycle`: plan, validate and benchmark fault-tolerant pipeline schedules from the shell.

The dispatcher of the `recycle` command: it builds one parser from the subcommand parsers of the
planner (plan, validate), the benchmarks (bench), the service (serve), the runtime (worker, launch,
store, agent, profile) and the what-if (whatif, simulate, precompute), and runs the chosen command through
planner.cli.run (exit codes there). It sits above every package it dispatches to; none of them imports
it (tests/test_layers.py). Run as `recycle ...` or `python -m recycle_cli ...`.
"""

from __future__ import annotations

import argparse

from planner.cli import add_planner_parsers, run

__all__ = ["build_parser", "main"]


def _environment_epilog() -> str:
    """The RECYCLE_* variables (from the settings classes, like docs/configuration.md)."""
    from api.settings import Settings
    from planner.settings import PlannerSettings, environment_rows
    from runtime_adapter.settings import RuntimeSettings

    rows = environment_rows(PlannerSettings, RuntimeSettings, Settings)
    lines = [f"  {var}={default}: {text}" for var, default, text in rows]
    return "environment variables (with defaults; docs/configuration.md):\n" + "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from api.cli import add_serve_parser
    from bench.planner import add_bench_parser
    from runtime_adapter.agent_cli import add_agent_parser
    from runtime_adapter.cli import add_launch_parser, add_profile_parser, add_store_parser, add_worker_parser
    from whatif.cli import add_whatif_parsers

    parser = argparse.ArgumentParser(
        prog="recycle",
        description=(__doc__ or "").splitlines()[0],
        epilog=_environment_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", required=True)

    add_planner_parsers(sub)  # plan, validate
    add_bench_parser(sub)

    add_serve_parser(sub)
    add_worker_parser(sub)
    add_launch_parser(sub)
    add_store_parser(sub)
    add_agent_parser(sub)
    add_profile_parser(sub)

    add_whatif_parsers(sub)  # whatif, simulate, precompute
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)
