"""One-pod Kubernetes Jobs of the trainer image that the steps run and read back: create or adopt, wait, read the log.

Used for the checkpoint verifier (:mod:`.verifier`) and preflight's AOT compiles
(:mod:`.aot`). A Job carries the spec-hash annotation of :mod:`.jobset`, so a
retried step adopts its own Job and a different Job under the same name is an
error, never a silent delete. Job status read (batch/v1 ``JobStatus``):
conditions ``Complete`` and ``Failed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from multislice import names
from multislice.backends.gke import jobset as jobsets
from multislice.backends.gke.client import Kube


def job_state(job: dict[str, Any]) -> str | None:
    """``Complete`` or ``Failed`` once the Job has that condition, else None."""
    for cond in job.get("status", {}).get("conditions", []) or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"]
    return None


def run_job(
    kube: Kube, body: dict[str, Any], *, timeout: float, on_progress: Callable[[str], None], what: str
) -> tuple[str, str, str | None]:
    """Create (or adopt) a Job, wait until it finishes, and read its pod's log.

    Args:
        kube: The API client.
        body: The Job manifest (its container is named ``names.TRAINER_CONTAINER``).
        timeout: Seconds to wait for ``Complete`` or ``Failed``.
        on_progress: Called with progress lines.
        what: What the Job is, for messages (``verifier Job``).

    Returns:
        ``(state, log, pod name)``: ``Complete`` or ``Failed``, the container's log ('' when
        no pod was found), and the pod's name or None.

    Raises:
        TimeoutError: not finished within ``timeout`` seconds (the Job was deleted, so nothing runs on).
        multislice.backends.gke.jobset.JobSetConflict: a Job of that name with another spec exists.
    """
    body = jobsets.with_spec_hash(body)
    name = body["metadata"]["name"]
    try:
        return _run_job(kube, body, name, timeout, on_progress, what)
    except KeyboardInterrupt:  # cancelled (multislice.cancel.Cancelled): the Job, created or not, goes too
        try:
            kube.call(
                kube.batch.delete_namespaced_job, name, kube.namespace, propagation_policy="Foreground",
                what=f"delete Job {name}",
            )  # fmt: skip
        except ApiException as error:
            if error.status != 404:
                raise
        raise


def _run_job(
    kube: Kube, body: dict[str, Any], name: str, timeout: float, on_progress: Callable[[str], None], what: str
) -> tuple[str, str, str | None]:
    try:
        kube.call(kube.batch.create_namespaced_job, kube.namespace, body, what=f"create Job {name}")
        on_progress(f"{what} {name} created ({body['spec']['template']['spec']['containers'][0]['image']})")
    except ApiException as error:
        if error.status != 409:
            raise
        existing = kube.api.sanitize_for_serialization(
            kube.call(kube.batch.read_namespaced_job, name, kube.namespace, what=f"get Job {name}")
        )
        wanted = body["metadata"]["annotations"][jobsets.SPEC_HASH_ANNOTATION]
        jobsets.adopt_or_conflict("Job", existing, wanted, kube.namespace)
        on_progress(f"{what} {name} exists with the same spec; adopted")
    deadline = time.monotonic() + timeout
    while True:
        job = kube.api.sanitize_for_serialization(
            kube.call(kube.batch.read_namespaced_job, name, kube.namespace, what=f"get Job {name}")
        )
        state = job_state(job)
        if state:
            break
        if time.monotonic() > deadline:
            kube.call(
                kube.batch.delete_namespaced_job, name, kube.namespace, propagation_policy="Foreground",
                what=f"delete Job {name}",
            )  # fmt: skip
            raise TimeoutError(f"{what} {name} still running after {timeout:.0f} s")
        time.sleep(kube.timings.poll_seconds)
    found = kube.call(
        kube.core.list_namespaced_pod, kube.namespace, label_selector=f"job-name={name}", what=f"list pods of {name}"
    )
    pod = found.items[-1].metadata.name if found.items else None
    log = ""
    if pod is not None:
        log = kube.call(
            kube.core.read_namespaced_pod_log, pod, kube.namespace, container=names.TRAINER_CONTAINER,
            what=f"read log of {pod}",
        )  # fmt: skip
    return state, log, pod
