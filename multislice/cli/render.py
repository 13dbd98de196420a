"""``multislice render``: every manifest of a profile, validated, written to a directory (no cluster)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from multislice import config
from multislice.cli.common import check_output, profile_and_overrides, with_profile
from multislice.errors import InputError
from multislice.plan import make_plan, restore_notes

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "render": "multislice render --profile gke-v6e-16x2 --output build/manifests/gke-v6e-16x2\n"
    "multislice render --profile local --output build/m --set num_slices=1 --set stages.1.dcn.fsdp=1",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice render`` with its handler (``argv``: the command line)."""
    render = sub.add_parser("render", help="write every manifest of a profile (dry run; no cluster needed)")
    with_profile(render)
    render.add_argument("--output", required=True, help="directory to write the YAML files to")
    render.add_argument("--pipeline-run-id", default="manual", help="value of the pipeline/runid label")
    render.set_defaults(func=cmd_render)


def cmd_render(args: argparse.Namespace) -> int:
    """Write every manifest of a profile, validated: Kueue objects, each stage's JobSet for TPU and CPU and,
    for backend gke, the RBAC objects and the node pool plan (the GKE API requests provision would send)."""
    from multislice.backends import manifests  # jsonschema and the CRDs: only for render (0.6 s)

    check_output("--output", args.output, directory=True)
    if problem := config.values.pipeline_run_id_problem(args.pipeline_run_id):
        raise InputError(f"--pipeline-run-id: {problem}", "give the value of the pipeline/runid label, e.g. manual")
    profile, overrides = profile_and_overrides(args)
    plan = make_plan(config.load_spec(profile, overrides))
    written = manifests.write_manifests(plan, Path(args.output), pipeline_run_id=args.pipeline_run_id)
    for path in written:
        print(path)
    print(
        f"{len(written)} files written to {args.output}; the JobSet and Kueue objects validate against the "
        "JobSet v0.12.0 / Kueue v0.19.2 CRDs, the RBAC objects against their API's fields"
    )
    print("what a restart of each stage restores from:")
    for note in restore_notes(plan):
        print(f"  {note}")
    if plan.spec.backend == "gke":
        plan_file = Path(args.output) / manifests.NODE_POOL_PLAN
        print(f"node pools provision would create (GKE API requests, not sent): {plan_file}")
        from multislice.backends.gke import nodepool  # the GKE clients (2-3 s): only for a gke profile

        print(manifests.in_place_note(plan))

        accounts = plan.spec.service_accounts
        writer = (
            f"the trainer's Google service account {accounts.trainer_gcp_service_account} (Workload Identity, "
            "no hostNetwork)"
            if accounts.tpu_workload_identity
            else "the TPU nodes' service account (hostNetwork pods get no Workload Identity), with the nodes' "
            f"scopes {', '.join(plan.spec.node_pools.oauth_scopes)}"
        )
        print(f"TPU pods write {plan.spec.output_dir} as {writer}; IAM bindings it needs (not applied):")
        for line in nodepool.iam_bindings(plan):
            print(f"  {line}")
    return 0
