"""The cluster's safety net for a cancelled run: a Lease per JobSet that its steps renew, and a reaper.

Why: on KFP, Terminate sets the Argo Workflow's ``activeDeadlineSeconds`` to 0
and the v2 exit handler most likely does not run (kubeflow/pipelines#10917);
a step's SIGTERM handler (:mod:`multislice.cancel`) deletes its JobSet, but a
SIGKILL after the grace period, a lost node or an evicted pod runs no
handler. An owner reference from the JobSet to the run's Workflow would not
bound the orphan's life: the KFP API server does not delete a terminated
run's Workflow (it stays until the run is deleted or the Workflow's TTL,
24 h by default, ends it), and Vertex AI has no Workflow object at all.

So a JobSet is owned, while it may hold TPUs, by a ``coordination.k8s.io/v1``
Lease of the same name (``spec.holderIdentity``, ``spec.leaseDurationSeconds``,
``spec.renewTime``: the Kubernetes Lease API), which the step that waits on
the JobSet renews every ``leaseDurationSeconds / 3`` (admit while it waits for
admission, launch, train): :class:`Holder`. The Lease has an owner reference
to its JobSet, so the garbage collector removes it with the JobSet. The
reaper (:func:`reap`; ``multislice reap``, run every minute by the CronJob of
:func:`reaper_cronjob`) deletes every unfinished JobSet of this project whose
Lease expired (or, without a Lease, whose creation is older than one lease
duration). An orphan is thus gone within ``lease_seconds`` plus the reaper's
period after its last renewal: :func:`orphan_bound`.

The gaps between steps (a step's pod ends, the next one's starts; a retried
step's backoff) are covered by the lease duration (:data:`LEASE_SECONDS`,
10 min: longer than the retry policy's longest backoff plus a pod start).
Finished JobSets (Completed, Failed) hold no TPUs and are never reaped.

The run's own Lease (:func:`hold_run`, ``multislice-run-<pipeline run id>``,
labelled with the run id and name, :data:`RUN_LEASE_SECONDS` long): every step of a pipeline run on GKE renews
it while it runs (:class:`RunHolder`, through
:meth:`multislice.backends.gke.GkeBackend.holding_run`), from the plan step to
export. Only the exit handler deletes it. So a run whose Lease expired is a run
no step and no exit handler is alive for: terminated on KFP (Argo stops the
step pods and, depending on its version, runs no exit handler), or killed.
The reaper then ends it as the exit handler would for a cancelled run
(:func:`multislice.steps.cleanup.reap_runs`): its unfinished workloads, the node
pools created for it, and the "cancelled" notification. That notification goes
out once: whoever sends it first creates the run's tombstone Lease
(:func:`claim_notification`; ``create`` is atomic at the API server, a second
create is 409 AlreadyExists), and the exit handler and the reaper both claim
before they post.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from multislice import names
from multislice.backends.gke import jobset, rayjob
from multislice.backends.gke.client import JOBSET_GROUP, JOBSET_VERSION, Kube

#: How long a Lease holds its JobSet without a renewal, seconds.
LEASE_SECONDS = 600
#: How long the run Lease (:func:`hold_run`) holds a pipeline run without a renewal, seconds (30 min). Longer than
#: a JobSet's: between two steps no step renews it, and on Vertex AI the next task's start (its scheduling, a CPU
#: node scaled up for it: minutes) must never look like a dead run, whose node pools the reaper would delete and
#: whose user it would tell "cancelled". A terminated run's workloads go sooner: its step's SIGTERM handler deletes
#: them, and each JobSet's own Lease (:data:`LEASE_SECONDS`) reaps them if the step was killed.
RUN_LEASE_SECONDS = 1800
#: How often the reaper CronJob runs (its schedule), seconds.
REAP_PERIOD_SECONDS = 60
LEASE_GROUP, LEASE_VERSION, LEASE_PLURAL = "coordination.k8s.io", "v1", "leases"


def orphan_bound(lease_seconds: int = LEASE_SECONDS, period: int = REAP_PERIOD_SECONDS) -> int:
    """The longest an orphaned JobSet outlives its last Lease renewal, seconds: the lease plus one reaper period."""
    return lease_seconds + period


#: The run Lease's name prefix (``multislice-run-<pipeline run id>``) and the notification tombstone's.
RUN_LEASE_PREFIX, NOTIFIED_PREFIX = "multislice-run-", "multislice-notified-"
#: Label on a run Lease (and a tombstone): which of the two it is.
LABEL_KIND = "multislice-pipelines/lease"
#: Annotations on a run Lease: the run's directory (where its reports are).
ANNOTATION_RUN_DIR = "multislice-pipelines/run-dir"
#: How long a notification tombstone is kept, seconds (the reaper deletes older ones): 7 days, longer than any
#: exit handler can come after its run's last step (KFP's and Vertex AI's run timeouts are shorter).
TOMBSTONE_SECONDS = 7 * 24 * 3600


def _dns_label(text: str) -> str:
    """``text`` as a DNS-1123 name part: lower-case, other characters as ``-``."""
    return "".join(c if c.isalnum() or c == "-" else "-" for c in text.lower()).strip("-")


def run_lease_name(pipeline_run_id: str) -> str:
    """``multislice-run-<id>``: the run Lease of a pipeline run (a KFP run id is a 36-character UUID)."""
    return RUN_LEASE_PREFIX + _dns_label(pipeline_run_id)[:200]


def tombstone_name(pipeline_run_id: str) -> str:
    """``multislice-notified-<id>``: exists once the run's final notification was claimed."""
    return NOTIFIED_PREFIX + _dns_label(pipeline_run_id)[:200]


def _micro_time(when: datetime.datetime) -> str:
    """A Kubernetes ``MicroTime`` (RFC 3339 with microseconds, UTC)."""
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: str) -> datetime.datetime:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))


def renew(kube: Kube, name: str, holder: str, seconds: int = LEASE_SECONDS, now: datetime.datetime | None = None):
    """Create or renew the Lease of JobSet (or RayJob) ``name``, owned by it; the Lease, or None if neither exists."""
    now = now or datetime.datetime.now(datetime.UTC)
    found, owner_api, owner_kind = kube.get_jobset(name), f"{JOBSET_GROUP}/{JOBSET_VERSION}", "JobSet"
    if found is None:  # a stage launched by Ray: its RayJob (multislice.backends.gke.rayjob) owns the Lease
        found, owner_api, owner_kind = rayjob.get(kube, name), "ray.io/v1", "RayJob"
    if found is None:
        return None
    meta = found["metadata"]
    body = {
        "apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": kube.namespace,
            "labels": {
                k: v
                for k, v in (meta.get("labels") or {}).items()
                if k.startswith("multislice") or k == names.LABEL_PIPELINE_RUN_ID
            },  # fmt: skip
            "ownerReferences": [
                {
                    "apiVersion": owner_api,
                    "kind": owner_kind,
                    "name": name,
                    "uid": meta.get("uid", ""),
                }
            ],  # fmt: skip
        },
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": int(seconds), "renewTime": _micro_time(now)},
    }
    try:
        return kube.call(
            kube.custom.patch_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
            name, {"spec": body["spec"]}, what=f"renew Lease {name}",
        )  # fmt: skip
    except ApiException as error:
        if error.status != 404:
            raise
    return kube.call(
        kube.custom.create_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
        body, what=f"create Lease {name}",
    )  # fmt: skip


def hold_run(
    kube: Kube,
    pipeline_run_id: str,
    run_name: str,
    run_dir: str,
    holder: str,
    seconds: int = RUN_LEASE_SECONDS,
    now: datetime.datetime | None = None,
) -> dict[str, Any]:
    """Create or renew the run Lease of ``pipeline_run_id`` (:func:`run_lease_name`), ``seconds`` long; the Lease.

    ``holder`` is ``<step>/<pod>``: the reaper's message and notification name the step that renewed it last.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    name = run_lease_name(pipeline_run_id)
    spec = {"holderIdentity": holder, "leaseDurationSeconds": int(seconds), "renewTime": _micro_time(now)}
    try:
        return kube.call(
            kube.custom.patch_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
            name, {"spec": spec}, what=f"renew Lease {name}",
        )  # fmt: skip
    except ApiException as error:
        if error.status != 404:
            raise
    labels = {LABEL_KIND: "run", names.LABEL_PIPELINE_RUN_ID: pipeline_run_id}
    if names.LABEL_VALUE.fullmatch(run_name) and len(run_name) <= names.MAX_LABEL_LENGTH:
        labels[names.LABEL_RUN_NAME] = run_name
    body = {
        "apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}",
        "kind": "Lease",
        "metadata": {
            "name": name, "namespace": kube.namespace, "labels": labels,
            "annotations": {ANNOTATION_RUN_DIR: run_dir, names.LABEL_RUN_NAME: run_name,
                            names.LABEL_PIPELINE_RUN_ID: pipeline_run_id},
        },
        "spec": spec,
    }  # fmt: skip
    try:
        return kube.call(
            kube.custom.create_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
            body, what=f"create Lease {name}",
        )  # fmt: skip
    except ApiException as error:  # another step of the run created it meanwhile: renew that one
        if error.status != 409:
            raise
    return kube.call(
        kube.custom.patch_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
        name, {"spec": spec}, what=f"renew Lease {name}",
    )  # fmt: skip


def expired_runs(kube: Kube, now: datetime.datetime | None = None) -> list[dict[str, Any]]:
    """The run Leases whose ``renewTime + leaseDurationSeconds`` is before ``now``: runs no step renews."""
    now = now or datetime.datetime.now(datetime.UTC)
    found = kube.call(
        kube.custom.list_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
        label_selector=f"{LABEL_KIND}=run", what="list run Leases",
    )  # fmt: skip
    return [item for item in found.get("items", []) if now > expires({"metadata": {}}, item)]


def claim_notification(kube: Kube, pipeline_run_id: str, state: str, by: str) -> bool:
    """Claim the right to post the run's final notification; True for the one caller that gets it.

    Creates the tombstone Lease :func:`tombstone_name` (``spec.holderIdentity``: ``by``; annotation: ``state``);
    a second create of the same name is 409 AlreadyExists at the API server, so of the exit handler and the
    reaper (or two reapers) exactly one posts.
    """
    body = {
        "apiVersion": f"{LEASE_GROUP}/{LEASE_VERSION}",
        "kind": "Lease",
        "metadata": {
            "name": tombstone_name(pipeline_run_id), "namespace": kube.namespace,
            "labels": {LABEL_KIND: "notified", names.LABEL_PIPELINE_RUN_ID: pipeline_run_id},
            "annotations": {"multislice-pipelines/state": state},
        },
        "spec": {"holderIdentity": by, "renewTime": _micro_time(datetime.datetime.now(datetime.UTC))},
    }  # fmt: skip
    try:
        kube.call(
            kube.custom.create_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
            body, what=f"create Lease {body['metadata']['name']}",
        )  # fmt: skip
    except ApiException as error:
        if error.status == 409:
            return False
        raise
    return True


def old_tombstones(kube: Kube, now: datetime.datetime | None = None) -> list[str]:
    """Names of notification tombstones older than :data:`TOMBSTONE_SECONDS` (the reaper deletes them)."""
    now = now or datetime.datetime.now(datetime.UTC)
    found = kube.call(
        kube.custom.list_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
        label_selector=f"{LABEL_KIND}=notified", what="list notification tombstones",
    )  # fmt: skip
    old = []
    for item in found.get("items", []):
        renewed = (item.get("spec") or {}).get("renewTime")
        if renewed and now - _parse_time(renewed) > datetime.timedelta(seconds=TOMBSTONE_SECONDS):
            old.append(item["metadata"]["name"])
    return old


def get(kube: Kube, name: str) -> dict[str, Any] | None:
    """The Lease ``name``, or None."""
    return kube._get(LEASE_GROUP, LEASE_VERSION, LEASE_PLURAL, name)


def expires(found_jobset: dict[str, Any], found_lease: dict[str, Any] | None) -> datetime.datetime:
    """When the JobSet's hold ends: the Lease's ``renewTime + leaseDurationSeconds``; without one, its creation plus
    :data:`LEASE_SECONDS` (a step that died between creating the JobSet and its Lease)."""
    spec = (found_lease or {}).get("spec") or {}
    if spec.get("renewTime"):
        return _parse_time(spec["renewTime"]) + datetime.timedelta(seconds=int(spec.get("leaseDurationSeconds", 0)))
    created = found_jobset["metadata"].get("creationTimestamp")
    start = _parse_time(created) if created else datetime.datetime.now(datetime.UTC)
    return start + datetime.timedelta(seconds=LEASE_SECONDS)


def reap(kube: Kube, now: datetime.datetime | None = None, tell: Callable[[str], None] = print) -> list[str]:
    """Delete every unfinished JobSet (or RayJob) of a pipeline run (label ``pipeline/runid``) whose hold expired;
    their names.

    Finished ones are kept (cleanup's rule); those of no pipeline run are never touched. One without its own Lease
    is reaped only when its pipeline run is one the reaper can account for: the run holds a run Lease
    (:func:`hold_run`; every step of a pipeline run on GKE creates or renews it before it creates anything, and only
    the exit handler or :func:`multislice.steps.cleanup.reap_runs` deletes it, after deleting the run's workloads).
    A JobSet applied by hand from ``multislice render`` output carries a run id label (``manual`` by default) but no
    Lease of either kind: it is not a pipeline run's, and is left to whoever applied it.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    deleted = []
    held_runs: dict[str, bool] = {}
    workloads = [("JobSet", found, jobset.phase, jobset.delete) for found in kube.list_jobsets("")]
    # Stages launched by Ray: their RayJobs (none when KubeRay or the Ray RBAC rules are absent, rayjob.NO_RAY).
    workloads += [("RayJob", found, rayjob.phase, rayjob.delete) for found in rayjob.list_rayjobs(kube, "")]
    for kind, found, phase_of, delete_workload in workloads:
        meta = found["metadata"]
        if names.LABEL_PIPELINE_RUN_ID not in (meta.get("labels") or {}) or meta.get("deletionTimestamp"):
            continue
        if phase_of(found) in ("Completed", "Failed"):
            continue
        own = get(kube, meta["name"])
        run_id = meta["labels"][names.LABEL_PIPELINE_RUN_ID]
        if own is None:
            if run_id not in held_runs:
                held_runs[run_id] = get(kube, run_lease_name(run_id)) is not None
            if not held_runs[run_id]:
                continue  # no Lease issued for it or its run: not created by a pipeline run the reaper knows
        ends = expires(found, own)
        if now > ends:
            tell(
                f"{kind} {kube.namespace}/{meta['name']} (pipeline run {meta['labels'][names.LABEL_PIPELINE_RUN_ID]})"
                f": its Lease expired at {_micro_time(ends)} with no step left to renew it; deleting it"
            )
            if delete_workload(kube, meta["name"], meta.get("uid")):  # that object, not one recreated since
                deleted.append(meta["name"])
            delete(kube, meta["name"])  # the garbage collector would too (owner reference): not left to it
    return deleted


def delete(kube: Kube, name: str) -> None:
    """Delete the Lease ``name`` (gone already is fine)."""
    try:
        kube.call(
            kube.custom.delete_namespaced_custom_object, LEASE_GROUP, LEASE_VERSION, kube.namespace, LEASE_PLURAL,
            name, what=f"delete Lease {name}",
        )  # fmt: skip
    except ApiException as error:
        if error.status != 404:
            raise


class Holder:
    """Renews a JobSet's Lease every ``seconds / 3`` in a daemon thread while its step waits on the JobSet.

    Use as a context manager; the first renewal happens on entry. ``stop()``
    ends the renewals (as a killed step's do). Renewal errors are told, not
    raised: the step's own waits report what is wrong with the cluster.
    """

    def __init__(self, kube: Kube, name: str, holder: str, seconds: int = LEASE_SECONDS, tell=None):
        self.kube, self.name, self.holder, self.seconds, self.tell = kube, name, holder, seconds, tell
        self.stopped = threading.Event()
        self.renewals = 0
        self.thread = threading.Thread(target=self._run, name=f"lease {name}", daemon=True)

    def _renew(self) -> None:
        try:
            renew(self.kube, self.name, self.holder, self.seconds)
            self.renewals += 1
        except Exception as error:  # noqa: BLE001 - told; the step's waits report the cluster's state
            if self.tell:
                self.tell(f"could not renew Lease {self.name}: {error}")

    def _run(self) -> None:
        while not self.stopped.wait(self.seconds / 3):
            self._renew()

    def stop(self) -> None:
        """End the renewals (the Lease then expires ``seconds`` after the last one)."""
        self.stopped.set()

    def __enter__(self) -> Holder:
        self._renew()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RunHolder(Holder):
    """Renews the run Lease (:func:`hold_run`) every ``seconds / 3`` while a step of the run runs.

    Stopping it (the step ended, was cancelled or killed) leaves the Lease as it is: the next step renews
    it, the exit handler deletes it, or it expires and the reaper ends the run.
    """

    def __init__(self, kube: Kube, pipeline_run_id: str, run_name: str, run_dir: str, holder: str,
                 seconds: int = RUN_LEASE_SECONDS, tell=None):  # fmt: skip
        super().__init__(kube, run_lease_name(pipeline_run_id), holder, seconds, tell)
        self.pipeline_run_id, self.run_name, self.run_dir = pipeline_run_id, run_name, run_dir

    def _renew(self) -> None:
        try:
            hold_run(self.kube, self.pipeline_run_id, self.run_name, self.run_dir, self.holder, self.seconds)
            self.renewals += 1
        except Exception as error:  # noqa: BLE001 - told; the step's own calls report the cluster's state
            if self.tell:
                self.tell(f"could not renew Lease {self.name}: {error}")


def reaper_command(namespace: str, cluster: Any) -> list[str]:
    """The reaper container's command: ``multislice reap`` on ``namespace`` of the cluster ``cluster`` names.

    ``cluster`` (a :class:`multislice.config.ClusterSpec`) gives ``--project``, ``--location`` and ``--cluster``
    as the rendered profile resolved them: the reaper deletes a terminated run's node pools through the GKE API
    of that cluster, and no profile is read in the pod (a profile of the user's is not in the pipeline image; a
    packaged one names a placeholder cluster). Argument list, never a shell string.
    """
    command = ["multislice", "reap", "--in-cluster", "--namespace", namespace]
    for option, value in (("--project", cluster.project), ("--location", cluster.location),
                          ("--cluster", cluster.name)):  # fmt: skip
        if value:
            command += [option, value]
    return command


def reaper_cronjob(
    namespace: str,
    image: str,
    service_account: str,
    cluster: Any,
    service_account_namespace: str | None = None,
    schedule: str = "* * * * *",
    webhook_secret: str = "multislice-notify-webhook",
) -> dict[str, Any]:
    """The CronJob that runs ``multislice reap`` on ``namespace`` every minute (the cluster-owned safety net).

    Args:
        namespace: Where the runs' workloads and Leases are (the run spec's ``namespace``).
        image: The pipeline image (it has the ``multislice`` command).
        service_account: The pipeline's ServiceAccount (``service_accounts.pipeline``).
        cluster: The :class:`multislice.config.ClusterSpec` the run acts on (:func:`reaper_command`).
        service_account_namespace: Where that ServiceAccount is (``service_accounts.pipeline_namespace``,
            default ``namespace``). The CronJob is created there: a pod can only run as a ServiceAccount of its own
            namespace (``spec.serviceAccountName``), and there the account has its Workload Identity annotation
            (the GKE API, node pools) and its RoleBinding to the Role in ``namespace``; the webhook Secret is read
            there too, as the exit handler's on KFP (its pods run in that namespace).

    Its service account needs ``list``/``delete`` on ``jobsets`` (and on ``rayjobs`` when a stage is launched by
    Ray) and ``get`` on ``leases`` in ``namespace`` (the pipeline runner's Role has them).
    ``concurrencyPolicy: Forbid``: one reaper at a time. The webhook URL comes, as the exit handler's on KFP,
    from key ``url`` of Secret ``webhook_secret`` (optional: without it no notification is posted). Deleting
    a terminated run's node pools needs the GKE API as the pipeline (Workload Identity: the same Google
    service account as provision, ``roles/container.clusterAdmin``).
    """
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": "multislice-reaper", "namespace": service_account_namespace or namespace},
        "spec": {
            "schedule": schedule,
            "concurrencyPolicy": "Forbid",
            "successfulJobsHistoryLimit": 1,
            "failedJobsHistoryLimit": 3,
            "jobTemplate": {"spec": {"backoffLimit": 0, "template": {"spec": {
                "serviceAccountName": service_account,
                "restartPolicy": "Never",
                "containers": [{"name": "reaper", "image": image, "command": reaper_command(namespace, cluster),
                    "env": [{"name": "MULTISLICE_NOTIFY_WEBHOOK_URL", "valueFrom": {"secretKeyRef": {
                        "name": webhook_secret, "key": "url", "optional": True}}}]}],
            }}}},
        },
    }  # fmt: skip
