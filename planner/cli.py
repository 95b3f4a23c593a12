"""The planner's subcommands of `recycle` (plan, validate) and the runner every subcommand goes through.

The `recycle` dispatcher itself is recycle_cli/ (it imports this module, never the other way round).

Exit codes: 0 success; 2 bad input (unreadable file, malformed JSON, invalid field, bad flag);
3 unrecoverable failure set (a stage with no alive worker); 4 a schedule that breaks a rule; 130
interrupted (Ctrl+C: one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from planner.cli_io import Once, finite_float
from planner.contract import FailureScenario, JobSpec, Schedule
from planner.errors import InvalidInputError, ScheduleRuleError, UnrecoverableScenarioError
from planner.outputs.gantt_stages import STAGE_VIEW_ABOVE

EXIT_INPUT, EXIT_UNRECOVERABLE, EXIT_INVALID = 2, 3, 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl+C
MAX_VALIDATE_ITERATIONS = 1000  # `recycle validate`'s K: the replay costs K x the ops


def _progress_printer(label: str = "planning") -> Callable[[str], None]:
    """A progress callback that stays quiet for the first second, then prints lines to stderr:
    "[  3.2 s elapsed] planning: <what the planner reports>"."""
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        elapsed = time.perf_counter() - t0
        if elapsed >= 1.0:
            print(f"[{elapsed:6.1f} s elapsed] {label}: {msg}", file=sys.stderr, flush=True)

    return progress


def _write_outputs(args: argparse.Namespace, schedule: Schedule, job: JobSpec) -> None:
    from planner.cli_io import make_parent, write_output

    if args.output:
        write_output(args.output, schedule.model_dump_json(indent=1, exclude_none=True) + "\n", "-o/--output")
    try:
        if args.gantt:
            from planner.outputs import write_gantt

            write_gantt(schedule, job, make_parent(args.gantt, "--gantt"), view=args.gantt_view)
        if args.trace:
            from planner.outputs import write_chrome_trace

            write_chrome_trace(schedule, job, make_parent(args.trace, "--trace"))
    except OSError as exc:
        raise InvalidInputError(f"cannot write {exc.filename or 'output'}: {exc.strerror or exc}") from exc


def cmd_plan(args: argparse.Namespace) -> int:
    from planner.cli_io import PICTURE_SUFFIXES, build_scenario, check_output, read_document
    from planner.cli_summary import render_summary
    from planner.figures import own_failure_free_ms
    from planner.plan import plan

    # Output paths are checked before planning, so a typo does not cost the plan.
    check_output(args.output, "-o/--output")
    check_output(args.gantt, "--gantt", PICTURE_SUFFIXES)
    check_output(args.trace, "--trace")
    job = read_document(args.job, JobSpec, "job spec")
    scenario = build_scenario(args.scenario, args.fail, args.slow)
    if args.time_limit <= 0:
        raise InvalidInputError("--time-limit must be positive (seconds)")
    limit, use_cpsat = timedelta(seconds=args.time_limit), not args.no_cpsat
    plan_job, repart = job, None
    if args.repartition:  # issue 12: choose the layer split too (planner/partition)
        from planner.partition.cli import plan_with_repartition

        result, plan_job, repart = plan_with_repartition(job, scenario, limit, use_cpsat, _progress_printer())
    else:
        result = plan(job, scenario, time_limit=limit, use_cpsat=use_cpsat, progress=_progress_printer())
    if scenario.failed or scenario.slow:
        reference = _progress_printer("planning the failure-free reference")
        own = own_failure_free_ms(job, limit, use_cpsat, progress=reference)
    else:
        own = result.iteration_time_ms
    fig = result.figures(own_failure_free_ms=own)
    if repart is not None:
        fig["repartition"] = repart
    try:
        if args.json:
            print(json.dumps(fig, indent=1), flush=True)
        else:
            print(render_summary(fig, fig["validation"]), flush=True)  # type: ignore[arg-type]
            if repart is not None:
                from planner.partition.cli import render_repartition

                print(render_repartition(repart), flush=True)
    finally:  # even when stdout is a closed pipe, the files are written
        _write_outputs(args, result.schedule, plan_job)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from planner.cli_io import describe_validation_error, read_document
    from planner.cli_summary import render_summary
    from planner.figures import schedule_figures
    from planner.simulator import validate

    job = read_document(args.job, JobSpec, "job spec")
    schedule = read_document(args.schedule, Schedule, "schedule")
    if args.scenario:
        scenario = read_document(args.scenario, FailureScenario, "failure scenario")
    else:
        try:
            scenario = schedule.scenario()
        except ValidationError as exc:  # e.g. a slow worker also listed as failed
            why = "; ".join(line.strip() for line in describe_validation_error(exc).splitlines())
            raise InvalidInputError(f"schedule {args.schedule}: its failure scenario: {why}") from None
    iterations = args.iterations if args.iterations is not None else schedule.replay_iterations or 4
    if iterations < 4:
        raise InvalidInputError("--iterations must be at least 4 (docs/contract.md section 4)")
    if iterations > MAX_VALIDATE_ITERATIONS:
        source = "--iterations" if args.iterations is not None else "the schedule's replay_iterations"
        raise InvalidInputError(
            f"{source} {iterations}: at most {MAX_VALIDATE_ITERATIONS} replayed iterations"
        )
    try:
        report = validate(job, scenario, schedule, num_iterations=iterations)
    except ScheduleRuleError as exc:
        if args.json:
            print(json.dumps({"valid": False, "rule": exc.rule, "error": str(exc)}))
        else:
            print(f"INVALID: {exc}")
        return EXIT_INVALID
    fig = schedule_figures(job, scenario, schedule, report)
    if args.json:
        print(json.dumps({"valid": True, **fig, "validation": report.to_dict()}, indent=1))
    else:
        print("VALID\n" + render_summary(fig, report.to_dict()))
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle plan`."""
    p = sub.add_parser("plan", help="plan a schedule for a job spec and a failure set")
    p.add_argument("job", help="job spec JSON (docs/contract.md section 1)")
    p.add_argument("--fail", action="append", default=[], metavar="D,S", help="a failed worker (repeatable)")
    p.add_argument(
        "--slow", action="append", default=[], metavar="D,S:FACTOR", help="a slow worker (repeatable)"
    )
    p.add_argument(
        "--scenario", action=Once, help="failure scenario JSON (docs/contract.md section 2); flags add to it"
    )
    p.add_argument("-o", "--output", help="write the schedule JSON here (missing directories are created)")
    p.add_argument(
        "--gantt", metavar="PATH.png|PATH.svg", help="write a Gantt chart here (PNG or SVG, by suffix)"
    )
    p.add_argument(
        "--gantt-view",
        choices=("auto", "workers", "stages"),
        default="auto",
        help="Gantt rows: one per worker, or one per stage (the share of its peers busy with each op); "
        f"auto (default) uses stages above {STAGE_VIEW_ABOVE} workers",
    )
    p.add_argument("--trace", help="write a Chrome trace JSON (open in Perfetto) here")
    p.add_argument(
        "--time-limit",
        type=finite_float,
        default=10.0,
        help="CP-SAT time limit in seconds (default 10); the greedy portfolio before it gets the same, "
        "or RECYCLE_GREEDY_BUDGET_S if smaller",
    )
    p.add_argument("--no-cpsat", action="store_true", help="greedy only, no CP-SAT refinement")
    p.add_argument(
        "--repartition",
        action="store_true",
        help="also choose which layers each stage holds (needs `layers` or `model.layers` in the job "
        "spec); prints the partition, its load bound, the best over all partitions and the migration",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    p.set_defaults(func=cmd_plan)


def add_validate_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`recycle validate`."""
    v = sub.add_parser("validate", help="replay a schedule and print its figures or the rule it breaks")
    v.add_argument("job", help="job spec JSON (docs/contract.md section 1)")
    v.add_argument("schedule", help="schedule JSON (docs/contract.md section 3)")
    v.add_argument(
        "--scenario", action=Once, help="failure scenario JSON (default: the schedule's own failed/slow)"
    )
    v.add_argument(
        "--iterations",
        type=int,
        default=None,
        help=f"replayed iterations K (4 to {MAX_VALIDATE_ITERATIONS}; default: the schedule's "
        "replay_iterations, else 4)",
    )
    v.add_argument("--json", action="store_true", help="print JSON")
    v.set_defaults(func=cmd_validate)


def add_planner_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """The planner's own subcommands, in `recycle --help` order: plan, validate."""
    add_plan_parser(sub)
    add_validate_parser(sub)


def _chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand parser `args` went through (the top-level parser if none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return _chosen_parser(chosen, args)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parse_args, except that unrecognized arguments are reported by the subcommand that got them
    (its usage and exit 2), not by the top-level parser."""
    words = sys.argv[1:] if argv is None else list(argv)
    args, extras = parser.parse_known_args(words)
    if extras:
        message = f"unrecognized arguments: {' '.join(extras)}"
        command = getattr(args, "command", None)
        before = words[: words.index(command)] if command in words else words
        if any(e in before for e in extras):  # given before the subcommand: the top level's
            parser.error(message)
        _chosen_parser(parser, args).error(message)
    _refuse_empty_values(_chosen_parser(parser, args), args)
    return args


def _refuse_empty_values(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--X=--` is a flag with no value: argparse drops the "--" and stores [] (appends [] for an
    appending flag) without calling the flag's type, so the command would get a list where it
    expects a number or a path (or no items where it needs one or more: nargs "+").
    Report it as argparse reports a flag without its value (exit 2)."""
    for action in parser._actions:
        if not action.option_strings or action.nargs not in (None, "?", "+"):
            continue
        value = getattr(args, action.dest, None)
        if value is action.default:  # not given (a default of [] stays the same object)
            continue
        appended = isinstance(action, argparse._AppendAction) and isinstance(value, list) and [] in value
        if value == [] or appended:
            expected = "at least one argument" if action.nargs == "+" else "one argument"
            parser.error(f"argument {'/'.join(action.option_strings)}: expected {expected}")


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse `argv` with `parser` (whose subcommands set `func`), run the command and map the planner's
    errors to the exit codes above. The `recycle` dispatcher (recycle_cli) and `python -m bench.planner`
    run through here."""
    args = parse_args(parser, argv)
    logging.basicConfig(
        level=logging.DEBUG if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args))
    except UnrecoverableScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNRECOVERABLE
    except InvalidInputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except ScheduleRuleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except BrokenPipeError:  # `recycle plan ... --json | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # Ctrl+C (commands with something to keep say more themselves)
        # On a terminal the line may hold a progress bar drawn in place (and the echoed ^C)
        print("\ninterrupted" if sys.stderr.isatty() else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
