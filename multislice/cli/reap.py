"""``multislice reap``: delete unfinished JobSets whose Lease expired (a cancelled run's orphans)."""

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
    reaper = sub.add_parser("reap", help="delete unfinished JobSets whose Lease expired (a cancelled run's orphans)")
    with_profile(reaper)
    reaper.add_argument("--namespace", help="namespace of the JobSets (default the profile's)")
    reaper.add_argument("--in-cluster", action="store_true", help="use the pod's service account (the CronJob)")
    reaper.set_defaults(func=cmd_reap)


def cmd_reap(args: argparse.Namespace) -> int:
    """Delete the unfinished JobSets of pipeline runs whose Lease expired (:func:`multislice.backends.gke.lease.reap`).

    The cluster's safety net for a cancelled run whose steps were killed before their handlers ran; the
    CronJob of :func:`multislice.backends.gke.lease.reaper_cronjob` runs it every minute. The cluster and
    namespace come from ``--profile`` (and ``--set``); ``--in-cluster`` uses the pod's service account.
    """
    from multislice.backends.gke import GkeBackend, lease  # the GKE clients (2-3 s): only for reap

    profile, overrides = profile_and_overrides(args)
    if args.in_cluster:
        overrides["cluster.access"] = "in-cluster"
    if args.namespace:
        overrides["namespace"] = args.namespace
    spec = config.load_spec(profile, {**overrides, "backend": "gke"})
    backend = GkeBackend.connect(spec.cluster, spec.namespace, say=print)
    deleted = lease.reap(backend.kube, tell=print)
    print(f"namespace {spec.namespace}: deleted {', '.join(deleted) if deleted else 'nothing (no expired Lease)'}")
    return 0
