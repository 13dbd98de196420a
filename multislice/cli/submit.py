"""``multislice submit``: one run to Vertex AI Pipelines or a KFP endpoint (or a dry run of it)."""

from __future__ import annotations

import argparse
from typing import Any

from multislice.cli.common import print_request, profile_and_overrides, with_profile
from multislice.delivery import submission
from multislice.delivery.submission import add_target_arguments

#: What replaces the packaged GKE profiles' placeholders, which submit and schedule refuse
#: (:func:`multislice.delivery.checks.placeholder_issues`).
DEPLOYMENT_SETS = (
    "--set output_dir=gs://my-bucket/runs --set cluster_project=my-project --set cluster_name=my-cluster \\\n"
    "    --set trainer_image=us-east5-docker.pkg.dev/my-project/multislice/multislice-trainer:0.1.0-3f2a9c1d0b7e \\\n"
    "    --set images.pipeline=us-east5-docker.pkg.dev/my-project/multislice/"
    "multislice-pipeline:0.1.0-3f2a9c1d0b7e \\\n"
    "    --set service_accounts.trainer_gcp_service_account=multislice-trainer@my-project.iam.gserviceaccount.com"
)
#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "submit": "multislice submit --profile gke-v6e-16x2 --target vertex --project my-project --location us-east5 \\\n"
    f"    {DEPLOYMENT_SETS} \\\n    --set stage1_steps=500 --dry-run\n"
    "multislice submit --profile my-gke.yaml --target kfp --host http://localhost:8888   "
    "# a profile with your own values",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice submit`` with its handler (``argv``: the command line)."""
    submit = sub.add_parser("submit", help="submit one run to Vertex AI Pipelines or a KFP endpoint")
    with_profile(submit)
    add_target_arguments(submit)
    submit.add_argument(
        "--continue",
        dest="continue_run",
        metavar="RUN",
        help="continue the earlier run RUN (its run_name as it ran): resume from its checkpoints instead of a new run",
    )
    submit.add_argument(
        "--dry-run", action="store_true", help="validate everything and print what would be sent; send nothing"
    )
    submit.set_defaults(func=cmd_submit)


def cmd_submit(args: argparse.Namespace) -> int:
    """Validate, compile and submit one run to Vertex AI Pipelines or KFP (:mod:`multislice.delivery.submission`)."""
    profile, overrides = profile_and_overrides(args)
    if args.dry_run:
        request = submission.dry_run(
            profile, overrides, target=args.target, continue_run=args.continue_run, **submission.targets_from_args(args)
        )
        print_request(request, f"run {request.run_name} would be submitted to {args.target}")
        return 0
    run = submission.submit(
        profile, overrides, target=args.target, continue_run=args.continue_run, **submission.targets_from_args(args)
    )
    print(f"submitted run {run.run_name} to {run.target}: {run.run_id}")
    for name, value in run.parameters.items():
        print(f"  {name} = {value!r}")
    return 0
