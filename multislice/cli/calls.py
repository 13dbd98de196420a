"""``multislice calls``: the remote calls recorded under an output directory, and their hosts' logs.

    multislice calls list [--output-dir D]
    multislice calls logs CALL_ID [--follow] [--host S,H] [--output-dir D]

A call is found by its record, ``<output_dir>/<call id>/remote/call.json``
(:class:`multislice.remote_call.RemoteJob`); ``--output-dir`` defaults to the
``local`` profile's ``output_dir`` resolved against the current directory,
which is also where a local call without ``output_dir`` goes. A call on GKE
needs its bucket: ``--output-dir gs://bucket/remote``; its backend and cluster
come from the profile recorded with it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from multislice.cli.common import check_output_dir
from multislice.errors import UserError
from multislice.remote_call import attach, list_calls

#: Columns of ``calls list``.
COLUMNS = ("CALL", "FUNCTION", "STATE", "HOSTS", "BACKEND", "CREATED")


#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "calls list": "multislice calls list --output-dir output\nmultislice calls list --output-dir gs://my-bucket/remote",
    "calls logs": "multislice calls logs remote-train-shard-c0ffee00 --follow\n"
    "multislice calls logs c0ffee00 --host 1,0 --output-dir gs://my-bucket/remote",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``calls list`` and ``calls logs`` with its handler (``argv``: the command line)."""
    calls = sub.add_parser(
        "calls",
        help="remote calls (multislice.remote): list them, read a host's log",
        description="List the remote calls recorded under an output directory, or print (and follow) one "
        "host's log of a call.",
        epilog="examples:\n  multislice calls list --output-dir output\n"
        "  multislice calls logs remote-train-shard-c0ffee00 --follow\n"
        "  multislice calls logs c0ffee00 --host 1,0 --output-dir gs://bucket/remote",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = calls.add_subparsers(dest="calls_action", required=True)
    listing = actions.add_parser("list", help="every call under --output-dir with its state")
    logs = actions.add_parser("logs", help="one host's log of a call (default the leader, slice 0 host 0)")
    logs.add_argument("call_id", help="the call id (remote-<function>-<id>), its JobSet name, or its 8-character id")
    logs.add_argument("--follow", action="store_true", help="keep printing new lines until the host's pod ends")
    logs.add_argument("--host", metavar="S,H", help="the host: slice S, host H within it (default 0,0)")
    for p in (listing, logs):
        p.add_argument("--output-dir", help="the calls' output_dir (default: the local profile's, here)")
    listing.set_defaults(func=cmd_calls_list)
    logs.set_defaults(func=cmd_calls_logs)


def _state(job: Any) -> str:
    """The call's state now, or its recorded state when its backend cannot be asked (a cluster not reachable)."""
    try:
        return job.status()
    except (UserError, OSError) as error:
        return f"{job.record['state']} (recorded; {str(error).splitlines()[0]})"


def cmd_calls_list(args: argparse.Namespace) -> int:
    """Print one line per call: id, function, state, hosts, backend, creation time (oldest first)."""
    check_output_dir("--output-dir", args.output_dir, "the calls' output_dir")
    jobs = list_calls(args.output_dir)
    if not jobs:
        print("no remote calls under " + (args.output_dir or "the local profile's output_dir"))
        return 0
    rows: list[tuple[object, ...]] = [COLUMNS]
    for job in jobs:
        record = job.record
        hosts = f"{record['num_slices']}x{record['tpu_type']} ({len(record['hosts'])})"
        rows.append((job.id, record["function"], _state(job), hosts, record["backend"], record["created"]))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def cmd_calls_logs(args: argparse.Namespace) -> int:
    """Print one host's log of a call; with ``--follow``, each line as it comes until the host's pod ends."""
    check_output_dir("--output-dir", args.output_dir, "the call's output_dir")
    job = attach(args.call_id, output_dir=args.output_dir)
    job.logs(follow=args.follow, host=args.host, out=sys.stdout)
    return 0
