"""A stage's KubeRay RayJob on the cluster (``launcher: ray``): create or adopt, read its state, its pods, delete.

The RayJob is the one :func:`multislice.render.ray.render_rayjob` renders. Fields read (KubeRay v1.7.0,
``ray-operator/apis/ray/v1/rayjob_types.go`` and ``raycluster_types.go``):

- ``status.jobDeploymentStatus``: ``Suspended`` while Kueue has not admitted it (Kueue's RayJob webhook sets
  ``spec.suspend`` on creation and its controller clears it on admission, ``pkg/controller/jobs/rayjob`` of
  Kueue v0.19.2: ``IsSuspended``/``RunWithPodSetsInfo``), then ``Initializing``, ``Running``, and at the end
  ``Complete`` or ``Failed`` (``IsJobDeploymentTerminal``);
- ``status.jobStatus``: the Ray job's own status, ``SUCCEEDED``, ``FAILED`` or ``STOPPED`` at the end. A Ray job
  that ends ``FAILED`` makes the deployment ``Failed`` with ``status.reason`` ``AppFailed``
  (``ray-operator/controllers/ray/rayjob_controller.go``); ``Complete`` with ``STOPPED`` is not a success either;
- ``status.reason`` and ``status.message``: why it failed (``AppFailed``, ``SubmissionFailed``,
  ``DeadlineExceeded``, ...);
- ``status.rayClusterName`` (``<rayjob>-<5 random>``, ``utils.GenerateRayClusterName``) and
  ``status.rayClusterStatus``: the RayCluster's status as KubeRay copies it while the job runs
  (``readyWorkerReplicas``, ``desiredWorkerReplicas``, the deprecated ``state`` that Kueue reads as PodsReady).

Pods are found by KubeRay's labels (``ray-operator/controllers/ray/utils/constant.go``): ``ray.io/cluster``
(the RayCluster), ``ray.io/node-type`` (``head``/``worker``), ``ray.io/group`` (the worker group),
``ray.io/worker-group-replica-index`` (the slice: one multi-host replica per slice) and
``ray.io/replica-host-index`` (the host in it). The driver's output is read from the submitter Job KubeRay
creates in ``K8sJobMode``: named as the RayJob, owned by it (``createNewK8sJob``), its pod labelled
``job-name=<rayjob>`` by the Job controller, container ``ray-job-submitter``
(``utils.SubmitterContainerName``, ``common.GetDefaultSubmitterContainer``); that container runs
``ray job submit`` and tails the Ray job's logs, the driver's and its workers' lines.

Idempotency is the JobSet's (:mod:`.jobset`): the spec-hash annotation; a retried step adopts a RayJob of the
same hash, a finished one of another pipeline run is replaced, anything else is a conflict.
"""

from __future__ import annotations

import re
import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from multislice import names
from multislice.backends.gke import jobset
from multislice.backends.gke.client import Kube

RAY_GROUP, RAY_VERSION, RAYJOB_PLURAL = "ray.io", "v1", "rayjobs"
CLAIM_GROUP, CLAIM_VERSION, CLAIM_PLURAL = "resource.k8s.io", "v1", "resourceclaimtemplates"
CLUSTER_LABEL = "ray.io/cluster"
NODE_TYPE_LABEL = "ray.io/node-type"
REPLICA_INDEX_LABEL = "ray.io/worker-group-replica-index"
HOST_INDEX_LABEL = "ray.io/replica-host-index"
SUBMITTER_CONTAINER = "ray-job-submitter"
#: The TPU worker container (:func:`multislice.render.ray.render_rayjob`).
WORKER_CONTAINER = "ray-worker"
#: The line each worker group attempt's leader prints (:mod:`multislice.trainer.ray_driver`, ``WORKER_LINE``):
#: Ray Train restarts inside the driver, so its restarts are the leader's starts minus one.
LEADER_LINE = re.compile(r"multislice ray worker: rank 0 of \d+")


#: Answers that mean "this run has no RayJobs": 404, KubeRay is not installed (the resource is not served); 403,
#: the pipeline's Role has no Ray rules, which :meth:`multislice.render.launchers.RayJobKind.rbac_rules` grants to
#: every run with a stage launched by Ray, so a run without one has created none. Cleanup, cancellation and the Lease
#: look for RayJobs by name or label whatever the launcher, and must not fail on a cluster or a run without Ray.
NO_RAY = (403, 404)


def get(kube: Kube, name: str) -> dict[str, Any] | None:
    """The RayJob ``name``, or None when it does not exist (or Ray is absent: :data:`NO_RAY`)."""
    try:
        return kube._get(RAY_GROUP, RAY_VERSION, RAYJOB_PLURAL, name)
    except ApiException as error:
        if error.status in NO_RAY:
            return None
        raise


def list_rayjobs(kube: Kube, label_selector: str) -> list[dict[str, Any]]:
    """RayJobs of the namespace matching a label selector (none when Ray is absent: :data:`NO_RAY`)."""
    try:
        found = kube.call(
            kube.custom.list_namespaced_custom_object, RAY_GROUP, RAY_VERSION, kube.namespace, RAYJOB_PLURAL,
            label_selector=label_selector, what="list RayJobs",
        )  # fmt: skip
    except ApiException as error:
        if error.status in NO_RAY:
            return []
        raise
    return found.get("items", [])


def phase(obj: dict[str, Any]) -> str:
    """``Completed``, ``Failed``, ``Suspended`` (Kueue has not admitted it) or ``Running`` (from ``status``)."""
    status = obj.get("status", {}) or {}
    deployment, job = status.get("jobDeploymentStatus"), status.get("jobStatus")
    if deployment == "Failed" or deployment == "ValidationFailed":
        return "Failed"
    if deployment == "Complete":
        return "Completed" if job == "SUCCEEDED" else "Failed"
    if obj.get("spec", {}).get("suspend") or deployment in ("Suspended", "Suspending"):
        return "Suspended"
    return "Running"


def describe(obj: dict[str, Any]) -> str:
    """``<phase>`` with the deployment and job status, and the reason and message when there are."""
    status = obj.get("status", {}) or {}
    text = (
        f"{phase(obj)} (jobDeploymentStatus {status.get('jobDeploymentStatus') or 'New'}, "
        f"jobStatus {status.get('jobStatus') or 'none'})"
    )
    if status.get("reason") or status.get("message"):
        text += f": {status.get('reason') or ''}: {status.get('message') or ''}"
    return text


def cluster_name(obj: dict[str, Any]) -> str | None:
    """``status.rayClusterName``: the RayCluster KubeRay created for it (None before)."""
    return (obj.get("status", {}) or {}).get("rayClusterName") or None


def create_or_adopt(
    kube: Kube, manifest: dict[str, Any], replaced: list[str] | None = None
) -> tuple[dict[str, Any], bool]:
    """Create the RayJob, adopt the existing one of the same spec hash, or replace a finished one of another run.

    Returns:
        ``(RayJob as stored, adopted)``.

    Raises:
        multislice.backends.gke.jobset.JobSetConflict: the name is taken by another spec.
        kubernetes.client.exceptions.ApiException: the API refused it (e.g. Kueue's RayJob webhook).
    """
    body = jobset.with_spec_hash(manifest)
    name = body["metadata"]["name"]
    try:
        created = kube.call(
            kube.custom.create_namespaced_custom_object, RAY_GROUP, RAY_VERSION, kube.namespace, RAYJOB_PLURAL,
            body, what=f"create RayJob {name}",
        )  # fmt: skip
        return created, False
    except ApiException as error:
        if error.status != 409:
            raise
    existing = get(kube, name)
    if existing is None:
        return create_or_adopt(kube, manifest, replaced)
    wanted = body["metadata"]["annotations"][jobset.SPEC_HASH_ANNOTATION]
    meta = existing.get("metadata", {})
    owner = (meta.get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID)
    ours = (manifest["metadata"].get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID)
    finished = phase(existing) in ("Completed", "Failed") and not meta.get("deletionTimestamp")
    if finished and owner and ours and owner != ours:
        delete(kube, name)
        deadline = time.monotonic() + kube.timings.admit_timeout
        while get(kube, name) is not None:
            if time.monotonic() > deadline:
                raise jobset.JobSetConflict(
                    f"RayJob {kube.namespace}/{name} of an earlier run was deleted to be replaced, but still exists "
                    f"after {kube.timings.admit_timeout:.0f} s",
                    "check its finalizers (KubeRay's ray.io/rayjob-finalizer) and retry the step",
                )
            time.sleep(kube.timings.poll_seconds)
        if replaced is not None:
            replaced.append(owner)
        return create_or_adopt(kube, manifest, replaced)
    return jobset.adopt_or_conflict("RayJob", existing, wanted, kube.namespace), True


def apply_claim_template(kube: Kube, template: dict[str, Any]) -> None:
    """Create a DRANET ResourceClaimTemplate of the stage; one that exists already is kept (same name, same run)."""
    try:
        kube.call(
            kube.custom.create_namespaced_custom_object, CLAIM_GROUP, CLAIM_VERSION, kube.namespace, CLAIM_PLURAL,
            template, what=f"create ResourceClaimTemplate {template['metadata']['name']}",
        )  # fmt: skip
    except ApiException as error:
        if error.status != 409:
            raise


def delete_claim_templates(kube: Kube, label_selector: str) -> list[str]:
    """Delete the ResourceClaimTemplates matching ``label_selector``; their names (none without Ray: :data:`NO_RAY`,
    the same rule grants them; a cluster without ``resource.k8s.io/v1`` answers 404)."""
    try:
        found = kube.call(
            kube.custom.list_namespaced_custom_object, CLAIM_GROUP, CLAIM_VERSION, kube.namespace, CLAIM_PLURAL,
            label_selector=label_selector, what="list ResourceClaimTemplates",
        )  # fmt: skip
    except ApiException as error:
        if error.status in NO_RAY:
            return []
        raise
    deleted = []
    for item in found.get("items", []):
        name, uid = item["metadata"]["name"], item["metadata"].get("uid")
        body = jobset.delete_options(uid)
        try:
            kube.call(
                kube.custom.delete_namespaced_custom_object, CLAIM_GROUP, CLAIM_VERSION, kube.namespace,
                CLAIM_PLURAL, name, what=f"delete ResourceClaimTemplate {name}", **({"body": body} if body else {}),
            )  # fmt: skip
            deleted.append(name)
        except ApiException as error:
            if error.status != 404 and not jobset.precondition_failed(error):
                raise
    return deleted


def delete(kube: Kube, name: str, uid: str | None = None) -> bool:
    """Delete the RayJob with foreground propagation; False when it was already gone (or, with ``uid``, is now
    another object of that name: :func:`.jobset.delete_options`).

    KubeRay's finalizer (``ray.io/rayjob-finalizer``) stops the Ray job first; the garbage collector then removes
    what the RayJob owns (controller references): the RayCluster with its pods, and the submitter Job.
    """
    body = jobset.delete_options(uid)
    try:
        kube.call(
            kube.custom.delete_namespaced_custom_object, RAY_GROUP, RAY_VERSION, kube.namespace, RAYJOB_PLURAL,
            name, propagation_policy="Foreground", what=f"delete RayJob {name}", **({"body": body} if body else {}),
        )  # fmt: skip
        return True
    except ApiException as error:
        if error.status == 404 or jobset.precondition_failed(error):
            return False
        raise


def cluster_pods(kube: Kube, obj: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """``(head pods, worker pods)`` of the RayJob's RayCluster (``V1Pod``), workers sorted by slice and host."""
    cluster = cluster_name(obj)
    if not cluster:
        return [], []
    found = kube.call(
        kube.core.list_namespaced_pod, kube.namespace, label_selector=f"{CLUSTER_LABEL}={cluster}",
        what=f"list pods of RayCluster {cluster}",
    )  # fmt: skip
    heads = [p for p in found.items if (p.metadata.labels or {}).get(NODE_TYPE_LABEL) == "head"]
    workers = [p for p in found.items if (p.metadata.labels or {}).get(NODE_TYPE_LABEL) == "worker"]
    return heads, sorted(workers, key=lambda p: (slice_of(p), host_of(p), p.metadata.name))


def slice_of(pod: Any) -> int:
    """A worker pod's slice: its multi-host replica index."""
    return int((pod.metadata.labels or {}).get(REPLICA_INDEX_LABEL) or 0)


def host_of(pod: Any) -> int:
    """A worker pod's host within its slice."""
    return int((pod.metadata.labels or {}).get(HOST_INDEX_LABEL) or 0)


def submitter_pods(kube: Kube, name: str) -> list[Any]:
    """The pods of the RayJob's submitter Job (label ``job-name``), oldest first."""
    found = kube.call(
        kube.core.list_namespaced_pod, kube.namespace, label_selector=f"job-name={name}",
        what=f"list submitter pods of RayJob {name}",
    )  # fmt: skip
    return sorted(found.items, key=lambda p: (str(p.metadata.creation_timestamp or ""), p.metadata.name))


def submitter(kube: Kube, name: str) -> Any | None:
    """The newest submitter pod (the Job's retries each have one), or None."""
    found = submitter_pods(kube, name)
    return found[-1] if found else None
