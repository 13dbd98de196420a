"""``multislice preflight``: AOT-compile each stage for its TPU topology; does it fit in HBM?"""

from __future__ import annotations

import argparse
from typing import Any

from multislice import backends, preflight, storage, timings
from multislice.cli.common import check_cache_dir, check_output, preflight_plan, with_profile, write_json
from multislice.steps import preflight as preflight_step

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "preflight": "multislice preflight --profile gke-v6e-16x2\n"
    "multislice preflight --profile gke-v6e-16x2-seed --stage seed-llama3-70b --no-alternative",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice preflight`` with its handler (``argv``: the command line)."""
    pre = sub.add_parser("preflight", help="AOT-compile each stage for the TPU topology: does it fit in HBM?")
    with_profile(pre)
    pre.add_argument("--stage", help="check only this stage (or example stage, e.g. seed-llama3-70b)")
    pre.add_argument(
        "--cache-dir",
        help="verdict cache (default: the profile's preflight.cache_dir, else ~/.cache/multislice-pipelines)",
    )
    pre.add_argument("--no-alternative", action="store_true", help="do not search a fitting alternative")
    pre.add_argument(
        "--on-cluster",
        action="store_true",
        help="compile as Jobs of the trainer image on the profile's cluster (default: on this machine)",
    )
    pre.add_argument("--report", help="also write the JSON report here")
    pre.set_defaults(func=cmd_preflight)


def cmd_preflight(args: argparse.Namespace) -> int:
    """AOT-compile the profile's stages for the target topology; exit 1 when one does not fit.

    The compiles run on this machine (the trainer environment) whatever the
    profile's backend, so no cloud credentials are needed; ``--on-cluster``
    runs them as Jobs of the trainer image on the profile's cluster instead.
    """
    from multislice.backends.local import LocalBackend  # jsonschema and the CRDs (0.5 s): local runs only

    if args.report:
        check_output("--report", args.report, directory=False, suffixes=(".json",))
    if args.cache_dir is not None:
        check_cache_dir("--cache-dir", args.cache_dir, remote_ok=args.on_cluster)
    extra: dict[str, Any] = {"preflight.skip": False, "preflight.suggest_alternative": not args.no_alternative}
    plan, stages = preflight_plan(args, extra)
    if args.on_cluster:
        cache = args.cache_dir or preflight.default_cache_dir(plan)
        backend = backends.backend_for(plan, say=print)
    else:
        cache = args.cache_dir or plan.spec.preflight.cache_dir or preflight.user_cache_dir()
        if not storage.is_remote(cache):
            check_cache_dir("preflight.cache_dir" if not args.cache_dir else "--cache-dir", cache, remote_ok=False)
        backend = LocalBackend(plan.run_dir, timings.timings_for(plan.spec, "local"))
    try:
        found = preflight_step.run(plan, stages, backend=backend, cache_dir=cache, write_reports=False)
    except preflight.PreflightFailed as error:
        write_json(args.report, {"verdict": "does_not_fit", "stages": [r.to_dict() for r in error.reports]})
        raise
    write_json(args.report, {"verdict": "fits", "stages": [r.to_dict() for r in found.values()]})
    print(f"preflight: all {len(found)} stage(s) fit on {plan.spec.num_slices} x {plan.spec.tpu_type}")
    return 0
