"""``multislice reap``: end runs whose hold expired (a terminated run's workloads, node pools, notification)."""

from __future__ import annotations

import argparse
from typing import Any

from multislice import config
from multislice.cli.common import profile_and_overrides, with_profile

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "reap": "multislice reap --profile gke-v6e-16x2",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice reap`` with its handler (``argv``: the command line)."""
    reaper = sub.add_parser(
        "reap", help="end terminated runs: their unfinished workloads, node pools and notification (Lease expired)"
    )
    with_profile(reaper)
    reaper.add_argument("--namespace", help="namespace of the JobSets (default the profile's)")
    reaper.add_argument("--in-cluster", action="store_true", help="use the pod's service account (the CronJob)")
    reaper.set_defaults(func=cmd_reap)


def cmd_reap(args: argparse.Namespace) -> int:
    """End the pipeline runs whose hold expired, then delete any unfinished JobSet or RayJob whose own Lease did.

    The cluster's safety net for a run terminated on KFP (no exit handler) or whose steps were killed
    before their handlers ran: :func:`multislice.steps.cleanup.reap_runs` (workloads, node pools created for
    the run, the ``CANCELLED`` notification once, to ``$MULTISLICE_NOTIFY_WEBHOOK_URL`` when set), then
    :func:`multislice.backends.gke.lease.reap`, and notification tombstones older than 7 days are deleted. The
    CronJob of :func:`multislice.backends.gke.lease.reaper_cronjob` runs it every minute. The cluster and
    namespace come from ``--profile`` (and ``--set``); ``--in-cluster`` uses the pod's service account.
    """
    from multislice.backends.gke import GkeBackend, lease  # the GKE clients (2-3 s): only for reap
    from multislice.steps import cleanup  # imports the backends: only for reap

    profile, overrides = profile_and_overrides(args)
    if args.in_cluster:
        overrides["cluster.access"] = "in-cluster"
    if args.namespace:
        overrides["namespace"] = args.namespace
    spec = config.load_spec(profile, {**overrides, "backend": "gke"})
    backend = GkeBackend.connect(spec.cluster, spec.namespace, say=print)
    ended = cleanup.reap_runs(backend, tell=print)
    deleted = lease.reap(backend.kube, tell=print)
    for name in lease.old_tombstones(backend.kube):
        lease.delete(backend.kube, name)
    for run in ended:
        print(f"pipeline run {run['pipeline_run_id']} ended: deleted {', '.join(run['deleted']) or 'nothing'}")
    print(f"namespace {spec.namespace}: deleted {', '.join(deleted) if deleted else 'nothing (no expired Lease)'}")
    return 0
