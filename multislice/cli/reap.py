"""``multislice reap``: end runs whose hold expired (a terminated run's workloads, node pools, notification)."""

from __future__ import annotations

import argparse
from typing import Any

from multislice import config, names
from multislice.cli.common import profile_and_overrides, with_profile
from multislice.config import values

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "reap": "multislice reap --profile gke-v6e-16x2\n"
    "multislice reap --in-cluster --namespace default --project my-proj --location us-east5 --cluster my-cluster",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice reap`` with its handler (``argv``: the command line)."""
    reaper = sub.add_parser(
        "reap", help="end terminated runs: their unfinished workloads, node pools and notification (Lease expired)"
    )
    with_profile(reaper, required=False)
    reaper.add_argument("--namespace", help="namespace of the JobSets (default the profile's)")
    reaper.add_argument("--in-cluster", action="store_true", help="use the pod's service account (the CronJob)")
    reaper.add_argument("--project", help="GKE cluster's project (default the profile's cluster.project)")
    reaper.add_argument("--location", help="GKE cluster's region or zone (default the profile's cluster.location)")
    reaper.add_argument("--cluster", help="GKE cluster's name (default the profile's cluster.name)")
    reaper.set_defaults(func=cmd_reap)


def reap_target(args: argparse.Namespace) -> tuple[config.ClusterSpec, str]:
    """The cluster and namespace ``multislice reap`` acts on: ``(cluster, namespace)``.

    ``--project``, ``--location``, ``--cluster`` and ``--namespace`` win over ``--profile`` (and its ``--set``);
    without ``--profile`` they are the whole reference (the CronJob's command, rendered from the resolved profile:
    :func:`multislice.backends.gke.lease.reaper_command`). ``--in-cluster``: the pod's ServiceAccount.

    Raises:
        multislice.config.ConfigError: no ``--profile`` and no ``--namespace``; a bad project, location, cluster name
            or namespace (naming the option); an invalid profile.
    """
    given = {key: value for key, value in (("cluster.project", args.project), ("cluster.location", args.location),
                                           ("cluster.name", args.cluster)) if value}  # fmt: skip
    if args.in_cluster:
        given["cluster.access"] = "in-cluster"
    if args.profile is None:
        problems = [] if args.namespace else [("--namespace", "without --profile, name the runs' namespace: "
                                               "--namespace NAME (and --project, --location, --cluster)")]  # fmt: skip
        if args.set:
            problems.append(("--set", "needs --profile; without it give --namespace, --project, --location, --cluster"))
        if args.namespace and not (names.DNS1123_LABEL.fullmatch(args.namespace) and len(args.namespace) <= 63):
            problems.append(("--namespace", f"{args.namespace!r} is not a namespace name (DNS-1123 label)"))
        for option, value, check in (("--project", args.project, values.gcp_project_problem),
                                     ("--location", args.location, values.gcp_location_problem),
                                     ("--cluster", args.cluster, values.gke_cluster_problem)):  # fmt: skip
            if value and (problem := check(value)):
                problems.append((option, problem))
        if problems:
            raise config.ConfigError(problems)
        return config.ClusterSpec(**{key.split(".", 1)[1]: value for key, value in given.items()}), args.namespace
    profile, overrides = profile_and_overrides(args)
    overrides.update(given)
    if args.namespace:
        overrides["namespace"] = args.namespace
    spec = config.load_spec(profile, {**overrides, "backend": "gke"})
    return spec.cluster, spec.namespace


def cmd_reap(args: argparse.Namespace) -> int:
    """End the pipeline runs whose hold expired, then delete any unfinished JobSet or RayJob whose own Lease did.

    The cluster's safety net for a run terminated on KFP (no exit handler) or whose steps were killed
    before their handlers ran: :func:`multislice.steps.cleanup.reap_runs` (workloads, node pools created for
    the run, the ``CANCELLED`` notification once, to ``$MULTISLICE_NOTIFY_WEBHOOK_URL`` when set), then
    :func:`multislice.backends.gke.lease.reap`, and notification tombstones older than 7 days are deleted. The
    CronJob of :func:`multislice.backends.gke.lease.reaper_cronjob` runs it every minute. The cluster and
    namespace: :func:`reap_target`.
    """
    from multislice.backends.gke import GkeBackend, lease  # the GKE clients (2-3 s): only for reap
    from multislice.steps import cleanup  # imports the backends: only for reap

    cluster, namespace = reap_target(args)
    backend = GkeBackend.connect(cluster, namespace, say=print)
    ended = cleanup.reap_runs(backend, tell=print)
    deleted = lease.reap(backend.kube, tell=print)
    for name in lease.old_tombstones(backend.kube):
        lease.delete(backend.kube, name)
    for run in ended:
        print(f"pipeline run {run['pipeline_run_id']} ended: deleted {', '.join(run['deleted']) or 'nothing'}")
    print(f"namespace {namespace}: deleted {', '.join(deleted) if deleted else 'nothing (no expired Lease)'}")
    return 0
