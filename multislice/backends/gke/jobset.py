"""A stage's JobSet on the cluster: create or adopt (spec hash), read its state, delete.

JobSet status fields read (JobSet v0.12.0, ``api/jobset/v1alpha2/jobset_types.go``):
``status.conditions`` of types ``Completed``, ``Failed`` and ``Suspended``
(reason and message), ``status.restarts`` (restarts so far under
``failurePolicy``), ``status.currentInPlaceRestartAttempt`` (in-place restarts) and
``status.terminalState``; ``spec.suspend``, which Kueue
sets while the Workload is not admitted
(https://kueue.sigs.k8s.io/docs/tasks/run/jobsets/).

Idempotency: the JobSet carries the annotation :data:`SPEC_HASH_ANNOTATION`,
a SHA-256 of the manifest as rendered (labels, annotations and spec). A
retried step that finds a JobSet of its name with the same hash adopts it.
A JobSet of the same name that another pipeline run left finished
(``Completed`` or ``Failed``: cleanup keeps completed ones, and a run that
continues an earlier one finds them) is replaced by design: deleted, then
created for this run, which resumes from the run directory's checkpoints.
Any other difference (an unfinished JobSet of another pipeline run, or of
this one with another spec) is :class:`JobSetConflict`, never a silent delete.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from kubernetes.client.exceptions import ApiException

from multislice import names
from multislice.backends.base import WorkloadConflict
from multislice.backends.gke.client import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, Kube

SPEC_HASH_ANNOTATION = "multislice-pipelines/spec-hash"


class JobSetConflict(WorkloadConflict):
    """A JobSet of that name exists with another spec (or is being deleted); the message says what to do."""


def spec_hash(manifest: dict[str, Any]) -> str:
    """SHA-256 (hex) of the manifest's labels, annotations (the hash itself excluded) and spec."""
    meta = manifest.get("metadata", {})
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if k != SPEC_HASH_ANNOTATION}
    canonical = {"labels": meta.get("labels", {}), "annotations": annotations, "spec": manifest.get("spec", {})}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()


def with_spec_hash(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of the manifest carrying its spec hash annotation."""
    copy = json.loads(json.dumps(manifest))
    copy["metadata"].setdefault("annotations", {})[SPEC_HASH_ANNOTATION] = spec_hash(manifest)
    return copy


def adopt_or_conflict(kind: str, existing: dict[str, Any], wanted: str, namespace: str) -> dict[str, Any]:
    """Return ``existing`` when its spec hash is ``wanted``; else raise JobSetConflict naming both runs.

    Raises:
        JobSetConflict: another spec, or the object is being deleted.
    """
    meta = existing["metadata"]
    name = meta["name"]
    if meta.get("deletionTimestamp"):
        raise JobSetConflict(
            f"{kind} {namespace}/{name} is being deleted (since {meta['deletionTimestamp']}); "
            "wait until it is gone and retry the step"
        )
    found = meta.get("annotations", {}).get(SPEC_HASH_ANNOTATION)
    if found == wanted:
        return existing
    owner = meta.get("labels", {}).get(names.LABEL_PIPELINE_RUN_ID, "unknown")
    raise JobSetConflict(
        f"{kind} {namespace}/{name} already exists with a different spec (pipeline run {owner}, spec hash "
        f"{(found or 'none')[:12]}, this run's {wanted[:12]}); nothing was changed. Choose another run_name, or "
        f"delete it yourself if it is no longer needed: kubectl delete {kind.lower()} -n {namespace} {name}"
    )


def replaceable(existing: dict[str, Any], manifest: dict[str, Any]) -> str | None:
    """The earlier pipeline run's id when ``existing`` is a finished JobSet of another pipeline run, else None.

    Finished: :func:`phase` ``Completed`` or ``Failed`` and not being deleted.
    Such a JobSet holds no TPUs; its checkpoints are in the run directory, so
    a run of the same name (one that continues it) replaces it.
    """
    meta = existing.get("metadata", {})
    if meta.get("deletionTimestamp") or phase(existing) not in ("Completed", "Failed"):
        return None
    owner = (meta.get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID)
    ours = (manifest.get("metadata", {}).get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID)
    return owner if owner and ours and owner != ours else None


def wait_gone(kube: Kube, name: str, timeout: float) -> None:
    """Poll until the JobSet ``name`` no longer exists (a foreground delete ends once its Jobs are gone).

    Raises:
        JobSetConflict: it still exists after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while kube.get_jobset(name) is not None:
        if time.monotonic() > deadline:
            raise JobSetConflict(
                f"JobSet {kube.namespace}/{name} of an earlier run was deleted to be replaced, but still exists "
                f"after {timeout:.0f} s",
                f"check its Jobs' finalizers (kubectl get jobs -n {kube.namespace} -l "
                f"jobset.sigs.k8s.io/jobset-name={name}) and retry the step",
            )
        time.sleep(kube.timings.poll_seconds)


def create_or_adopt(
    kube: Kube, manifest: dict[str, Any], replaced: list[str] | None = None
) -> tuple[dict[str, Any], bool]:
    """Create the JobSet, adopt the existing one of the same name and spec hash, or replace a finished one.

    A finished JobSet of another pipeline run (:func:`replaceable`) is deleted
    (foreground), waited for and created anew; its pipeline run's id is
    appended to ``replaced`` when given.

    Returns:
        ``(JobSet as stored, adopted)``.

    Raises:
        JobSetConflict: the name is taken by another spec (an unfinished JobSet, or one of this pipeline run).
        kubernetes.client.exceptions.ApiException: the API refused the JobSet (e.g. 422 from JobSet's webhook).
    """
    body = with_spec_hash(manifest)
    name = body["metadata"]["name"]
    try:
        created = kube.call(
            kube.custom.create_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, kube.namespace,
            JOBSET_PLURAL, body, what=f"create JobSet {name}",
        )  # fmt: skip
        return created, False
    except ApiException as error:
        if error.status != 409:
            raise
    existing = kube.get_jobset(name)
    if existing is None:  # deleted between the two calls: create once more
        return create_or_adopt(kube, manifest, replaced)
    wanted = body["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
    earlier = replaceable(existing, manifest)
    if earlier and existing["metadata"].get("annotations", {}).get(SPEC_HASH_ANNOTATION) != wanted:
        delete(kube, name)
        wait_gone(kube, name, kube.timings.admit_timeout)
        if replaced is not None:
            replaced.append(earlier)
        return create_or_adopt(kube, manifest, replaced)
    return adopt_or_conflict("JobSet", existing, wanted, kube.namespace), True


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The status condition of type ``kind`` when its status is True, else None."""
    for item in obj.get("status", {}).get("conditions", []) or []:
        if item.get("type") == kind and item.get("status") == "True":
            return item
    return None


def restarts(obj: dict[str, Any]) -> int:
    """``status.restarts``: how many times the JobSet was restarted (0 at first)."""
    return int(obj.get("status", {}).get("restarts", 0) or 0)


def in_place_restarts(obj: dict[str, Any]) -> int:
    """In-place restarts so far under ``restartStrategy: InPlaceRestart``: ``status.currentInPlaceRestartAttempt``
    (JobSet v0.12.0 sets it once every pod's agent reached the same attempt, ``pkg/controllers/in_place_restart.go``;
    0 at first, absent before the first barrier). ``status.restarts`` does not count these."""
    return int(obj.get("status", {}).get("currentInPlaceRestartAttempt", 0) or 0)


def phase(obj: dict[str, Any]) -> str:
    """``Completed``, ``Failed``, ``Suspended`` (Kueue has not admitted it) or ``Running``."""
    for kind in ("Completed", "Failed"):
        if condition(obj, kind):
            return kind
    terminal = obj.get("status", {}).get("terminalState")
    if terminal in ("Completed", "Failed"):
        return terminal
    if obj.get("spec", {}).get("suspend"):
        return "Suspended"
    return "Running"


def describe(obj: dict[str, Any]) -> str:
    """``<phase>`` plus the reason and message of its condition, and the restarts."""
    state = phase(obj)
    cond = condition(obj, state) or {}
    detail = f" ({cond.get('reason')}: {cond.get('message')})" if cond else ""
    return f"{state}{detail}, restarts {restarts(obj)}"


def run_selector(pipeline_run_id: str) -> str:
    """Label selector of everything one pipeline run created."""
    return f"{names.LABEL_PIPELINE_RUN_ID}={pipeline_run_id}"


def delete_options(uid: str | None) -> dict[str, Any] | None:
    """A ``DeleteOptions`` body with foreground propagation and, with ``uid``, the precondition that the object
    deleted is that one: the API server refuses with 409 Conflict ("Precondition failed: UID in precondition")
    when the name now belongs to another object (k8s.io/apiserver ``pkg/storage/etcd3/store.go``,
    ``checkPreconditions``). None without ``uid``."""
    if not uid:
        return None
    return {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Foreground",
            "preconditions": {"uid": uid}}  # fmt: skip


def precondition_failed(error: ApiException) -> bool:
    """True for the API server's answer to a delete whose ``uid`` precondition no longer holds (409 Conflict)."""
    return error.status == 409 and "precondition" in str(error.body or error.reason or "").lower()


def delete(kube: Kube, name: str, uid: str | None = None) -> bool:
    """Delete a JobSet and (foreground) its Jobs and pods; False when it was already gone.

    With ``uid``, only that JobSet (:func:`delete_options`): one created since under the same name (another
    run's) is left, and False returned.
    """
    body = delete_options(uid)
    try:
        kube.call(
            kube.custom.delete_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, kube.namespace,
            JOBSET_PLURAL, name, propagation_policy="Foreground", what=f"delete JobSet {name}",
            **({"body": body} if body else {}),
        )  # fmt: skip
        return True
    except ApiException as error:
        if error.status == 404 or precondition_failed(error):
            return False
        raise


def replicas(obj: dict[str, Any]) -> int:
    """Slices of a JobSet: the summed ``replicas`` of its replicated jobs (``spec.replicatedJobs[].replicas``)."""
    return sum(int(job.get("replicas", 1)) for job in obj.get("spec", {}).get("replicatedJobs", []))
