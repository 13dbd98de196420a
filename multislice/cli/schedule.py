"""``multislice schedule create|list|update|pause|resume|delete``: recurring runs."""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

from multislice import config
from multislice.cli.common import print_request, profile_and_overrides, with_profile
from multislice.cli.submit import DEPLOYMENT_SETS
from multislice.delivery import schedule, submission
from multislice.delivery.submission import add_target_arguments

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "schedule": "multislice schedule create --profile my-gke.yaml --target kfp --host http://localhost:8888 \\\n"
    "    --cron '0 3 * * *'\n"
    "multislice schedule list --target kfp --host http://localhost:8888",
    "schedule create": "multislice schedule create --profile gke-v6e-16x2 --target vertex --project my-project \\\n"
    "    --location us-east5 --cron '0 3 * * 1-5' --timezone Europe/Paris \\\n"
    f"    {DEPLOYMENT_SETS} --dry-run\n"
    "multislice schedule create --profile my-gke.yaml --target kfp --host http://localhost:8888 \\\n"
    "    --cron '0 3 * * *'   # a profile with your own bucket, cluster and images",
    "schedule list": "multislice schedule list --target vertex --project my-project --location us-east5",
    "schedule update": "multislice schedule update SCHEDULE_ID --target vertex --project my-project "
    "--location us-east5 \\\n    --cron '0 4 * * *' --dry-run",
    "schedule pause": "multislice schedule pause SCHEDULE_ID --target kfp --host http://localhost:8888",
    "schedule resume": "multislice schedule resume SCHEDULE_ID --target vertex --project my-project "
    "--location us-east5 --catch-up",
    "schedule delete": "multislice schedule delete SCHEDULE_ID --target kfp --host http://localhost:8888",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice schedule`` with its handler (``argv``: the command line)."""
    sched = sub.add_parser("schedule", help="recurring runs: create, list, update, pause, resume, delete")
    actions = sched.add_subparsers(dest="action", required=True, metavar="ACTION")
    # Each action is its own sub-command, so that `schedule create --help` prints create's options.
    schedule_actions = {
        "create": "create a schedule of the profile's pipeline (--cron, or --interval on KFP)",
        "list": "list the schedules of the target",
        "update": "change a Vertex AI schedule in place (KFP cannot update: delete and create)",
        "pause": "pause a schedule", "resume": "resume a paused schedule", "delete": "delete a schedule",
    }  # fmt: skip
    for action, text in schedule_actions.items():
        act = actions.add_parser(action, help=text, description=text)
        if action == "create":
            with_profile(act)
        elif action != "list":
            act.add_argument("schedule_id", nargs="?", help="the schedule's ID (see `multislice schedule list`)")
        add_target_arguments(act)
        if action in ("create", "update"):
            _add_schedule_options(act, create=action == "create")
            act.add_argument(
                "--dry-run", action="store_true", help="validate everything and print what would be sent; send nothing"
            )
        if action == "resume":
            act.add_argument("--catch-up", action="store_true", help="start the runs missed while paused (Vertex)")
        taken = {a.dest for a in act._actions}
        act.set_defaults(func=cmd_schedule, **{k: None for k in _SCHEDULE_OPTIONS if k not in taken})


#: The Python API's argument names (:func:`multislice.delivery.schedule.create`, ``update``) as the CLI's flags, so
#: that an error names the flag the user typed.
_FLAGS = {
    "cron": "--cron", "timezone": "--timezone", "interval_seconds": "--interval", "name": "--name",
    "max_concurrent_runs": "--max-concurrent-runs", "allow_queueing": "--allow-queueing", "catch_up": "--catch-up",
    "max_runs": "--max-runs", "start_time": "--start-time", "end_time": "--end-time", "continue_run": "--continue-run",
}  # fmt: skip


def cmd_schedule(args: argparse.Namespace) -> int:
    """Create, list, pause, resume or delete schedules (:mod:`multislice.delivery.schedule`); an error names the
    flag (``--cron``, ``--max-runs``...) rather than the Python argument."""
    try:
        return _schedule(args)
    except config.ConfigError as error:
        if not any(field in _FLAGS for field, _ in error.issues):
            raise
        raise type(error)([(_FLAGS.get(field, field), message) for field, message in error.issues]) from None


def _schedule(args: argparse.Namespace) -> int:
    where = submission.targets_from_args(args)
    if args.action == "create":
        missing = [("--profile", "required by `schedule create`")] if not args.profile else []
        if not args.cron and not args.interval:
            missing.append(("--cron", "required by `schedule create` (or --interval SECONDS on KFP)"))
        if missing:
            raise config.ConfigError(missing)
        profile, overrides = profile_and_overrides(args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", schedule.CatchUpWarning)
            made = schedule.create(
                profile, overrides, target=args.target, cron=args.cron, timezone=args.timezone,
                interval_seconds=args.interval, name=args.name,
                max_concurrent_runs=1 if args.max_concurrent_runs is None else args.max_concurrent_runs,
                allow_queueing=args.allow_queueing, catch_up=args.catch_up, max_runs=args.max_runs,
                start_time=args.start_time, end_time=args.end_time, continue_run=args.continue_run,
                dry_run=args.dry_run, **where,
            )  # fmt: skip
        _print_warnings(caught)
        if made.request is not None:
            print_request(made.request, f"schedule {made.name} would be created on {made.target}")
        else:
            print(f"schedule {made.name} created on {made.target}: {made.schedule_id}, cron {made.cron!r}")
        print(f"catch-up: {'on' if args.catch_up else 'off (missed runs are skipped)'}")
        if args.cron:
            next_times = schedule.Cron.parse(args.cron, args.timezone).next_times()
            zone = "" if args.timezone or args.target != "kfp" else " (UTC; KFP uses its CRON_SCHEDULE_TIMEZONE)"
            print("next runs: " + ", ".join(t.isoformat() for t in next_times) + zone)
    elif args.action == "list":
        for found in schedule.list_schedules(args.target, **where):
            print(f"{found.schedule_id}\t{found.name}\t{found.cron}\t{found.state}")
    elif args.action == "update":
        if not args.schedule_id:
            raise config.ConfigError([("SCHEDULE_ID", "`schedule update` needs the schedule's ID (see list)")])
        made = schedule.update(
            args.schedule_id, args.target, cron=args.cron, timezone=args.timezone, name=args.name,
            max_concurrent_runs=args.max_concurrent_runs, allow_queueing=args.allow_queueing or None,
            max_runs=args.max_runs, start_time=args.start_time, end_time=args.end_time, dry_run=args.dry_run,
            **where,
        )  # fmt: skip
        if made.request is not None:
            print_request(made.request, f"schedule {made.schedule_id} would be updated")
        else:
            print(f"schedule {made.schedule_id} updated: {made.name}, cron {made.cron!r}")
    else:
        if not args.schedule_id:
            raise config.ConfigError([("SCHEDULE_ID", f"`schedule {args.action}` needs the schedule's ID (see list)")])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", schedule.CatchUpWarning)
            schedule.change(args.action, args.schedule_id, args.target, catch_up=args.catch_up, **where)
        _print_warnings(caught)
        print(f"schedule {args.schedule_id}: {args.action} sent")
    return 0


def _print_warnings(caught: list[warnings.WarningMessage]) -> None:
    """Print caught warnings on stderr, ``warning: <message>``."""
    for item in caught:
        print(f"warning: {item.message}", file=sys.stderr)


#: Every ``schedule`` option's destination, None where an action does not take it.
_SCHEDULE_OPTIONS = (
    "profile", "set", "schedule_id", "cron", "timezone", "interval", "name", "max_concurrent_runs", "allow_queueing",
    "catch_up", "start_time", "end_time", "max_runs", "continue_run", "dry_run",
)  # fmt: skip


def _add_schedule_options(act: argparse.ArgumentParser, create: bool) -> None:
    """The options of ``schedule create`` (``create``) or ``schedule update``."""
    act.add_argument("--cron", help="5 fields: minute hour day-of-month month day-of-week, e.g. '0 3 * * *'")
    act.add_argument(
        "--timezone", help="IANA time zone of --cron (Vertex only; KFP uses its controller's CRON_SCHEDULE_TIMEZONE)"
    )
    if create:
        act.add_argument("--interval", type=int, metavar="SECONDS", help="KFP only, instead of --cron: every N seconds")
    act.add_argument("--name", help="display name" + (" (default <run_name>-schedule)" if create else ""))
    default = " (default 1)" if create else ""
    act.add_argument("--max-concurrent-runs", type=int, help=f"runs of this schedule at once{default}")
    act.add_argument(
        "--allow-queueing", action="store_true", help="Vertex only: a run due at the concurrency limit waits"
    )
    if create:
        act.add_argument(
            "--catch-up",
            action="store_true",
            help="KFP: start the runs missed since --start-time and while disabled; off by default",
        )
    act.add_argument("--start-time", metavar="RFC3339", help="first run not before, e.g. 2026-12-01T03:00:00Z")
    act.add_argument("--end-time", metavar="RFC3339", help="no run after, e.g. 2027-03-01T00:00:00Z")
    act.add_argument("--max-runs", type=int, help="stop after this many runs (Vertex only)")
    if create:
        act.add_argument(
            "--continue-run",
            action="store_true",
            help="every run continues the same run_name (one long training run) instead of a new one",
        )
