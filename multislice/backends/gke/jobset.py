"""A stage's JobSet on the cluster: create or adopt (spec hash), read its state, delete.

JobSet status fields read (JobSet v0.12.0, ``api/jobset/v1alpha2/jobset_types.go``):
``status.conditions`` of types ``Completed``, ``Failed`` and ``Suspended``
(reason and message), ``status.restarts`` (restarts so far under
``failurePolicy``) and ``status.terminalState``; ``spec.suspend``, which Kueue
sets while the Workload is not admitted
(https://kueue.sigs.k8s.io/docs/tasks/run/jobsets/).

Idempotency: the JobSet carries the annotation :data:`SPEC_HASH_ANNOTATION`,
a SHA-256 of the manifest as rendered (labels, annotations and spec). A
retried step that finds a JobSet of its name with the same hash adopts it; a
different hash is :class:`JobSetConflict`, never a silent delete.
"""

from __future__ import annotations

import hashlib
import json
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


def create_or_adopt(kube: Kube, manifest: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """Create the JobSet, or adopt the existing one of the same name and spec hash.

    Returns:
        ``(JobSet as stored, adopted)``.

    Raises:
        JobSetConflict: the name is taken by another spec.
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
        return create_or_adopt(kube, manifest)
    wanted = body["metadata"]["annotations"][SPEC_HASH_ANNOTATION]
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


def delete(kube: Kube, name: str) -> bool:
    """Delete a JobSet and (foreground) its Jobs and pods; False when it was already gone."""
    try:
        kube.call(
            kube.custom.delete_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, kube.namespace,
            JOBSET_PLURAL, name, propagation_policy="Foreground", what=f"delete JobSet {name}",
        )  # fmt: skip
        return True
    except ApiException as error:
        if error.status == 404:
            return False
        raise
