"""``multislice inject``: local backend fault injection (preempt a slice, give capacity back)."""

from __future__ import annotations

import argparse
from typing import Any

from multislice import names, storage
from multislice.cli.common import locate_run, run_spec_of, with_profile
from multislice.errors import InputError

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "inject": "multislice inject preempt-slice --run elastic-demo-20261201-030000 --profile elastic \\\n"
    "    --stage tiny-elastic --slice 1 --for 90\n"
    "multislice inject restore-capacity --run elastic-demo-20261201-030000 --profile elastic",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice inject`` with its handler (``argv``: the command line)."""
    inject = sub.add_parser("inject", help="local backend: preempt a slice (Spot) or give its capacity back")
    inject.add_argument("action", choices=["preempt-slice", "restore-capacity"])
    inject.add_argument("--run", required=True, help="the run's run_name")
    inject.add_argument("--stage", help="the stage whose JobSet loses the slice (preempt-slice)")
    inject.add_argument("--slice", type=int, help="slice index, from 0 (restore-capacity: default every slice)")
    inject.add_argument("--for", dest="seconds", type=float, help="seconds the capacity stays away (default: until "
                        "restore-capacity)")  # fmt: skip
    inject.add_argument("--output-dir", help="the run's output_dir (default: the profile's)")
    with_profile(inject, required=False)
    inject.set_defaults(func=cmd_inject)


def cmd_inject(args: argparse.Namespace) -> int:
    """Fault injection on the local backend: Spot-preempt one slice of a running stage, or give capacity back.

    ``preempt-slice`` withdraws slice ``--slice``'s capacity (for ``--for`` seconds, or until ``restore-capacity``)
    and SIGKILLs that slice's pods of the stage's JobSet (:func:`multislice.backends.local.capacity.preempt_slice`);
    ``restore-capacity`` gives the slice (or every slice) back. The run is ``<output_dir>/<run>``, with
    ``output_dir`` from ``--output-dir``, else the profile's; its slices and stages from its plan report, else the
    profile.
    """
    from multislice.backends.local import capacity  # jsonschema and the CRDs (0.5 s): local runs only

    spec, found = locate_run(args)  # --run and --output-dir checked first
    spec = run_spec_of(found.run_dir) or spec
    if spec is None or not storage.path(found.run_dir).is_dir():
        raise InputError(f"--run {args.run}: no run directory {found.run_dir}", "check --run and --output-dir")
    if spec.get("backend") != "local":
        raise InputError(
            f"run {args.run} is on the {spec.get('backend')} backend; fault injection is for the local backend",
            "on GKE, preempt a slice by deleting its node pool's nodes (or wait for Spot to do it)",
        )
    slices = int(spec["num_slices"])
    if args.action == "restore-capacity":
        ended = capacity.restore(found.run_dir, args.slice)
        print(f"run {args.run}: {ended} withdrawn slice(s) given back; {capacity.available(found.run_dir)} available")
        return 0
    stages = [s["name"] for s in spec["stages"]]
    if args.stage not in stages:
        raise InputError(f"--stage {args.stage!r} is not a stage of run {args.run}", f"use one of {', '.join(stages)}")
    if args.slice is None or not 0 <= args.slice < slices:
        raise InputError(f"--slice {args.slice} is not a slice of run {args.run}", f"give 0 to {slices - 1}")
    if args.seconds is not None and args.seconds < 0:
        raise InputError(
            f"--for {args.seconds:g} is negative", "give the seconds the capacity stays away, or leave out"
        )
    jobset = names.jobset_name(args.run, args.stage)
    for line in capacity.preempt_slice(found.run_dir, jobset, slices, args.slice, args.seconds):
        print(line)
    until = "until restore-capacity" if args.seconds is None else f"for {args.seconds:g} s"
    print(f"slice {args.slice} of run {args.run} preempted: capacity withdrawn {until}")
    return 0
