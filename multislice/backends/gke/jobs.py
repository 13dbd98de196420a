"""One-pod Kubernetes Jobs of the trainer image that the steps run and read back: create or adopt, wait, read the log.

Used for the checkpoint verifier (:mod:`.verifier`) and preflight's AOT compiles
(:mod:`.aot`). A Job carries the spec-hash annotation of :mod:`.jobset`, so a
retried step adopts its own Job and a different Job under the same name is an
error, never a silent delete. Job status read (batch/v1 ``JobStatus``):
conditions ``Complete`` and ``Failed``. While it runs, its pod (label
``job-name``) is read too: a pod the scheduler cannot place (``PodScheduled``
False, reason ``Unschedulable``, core v1 ``PodCondition``) for
``timings.job_unschedulable_grace`` ends the wait with the scheduler's message
(:class:`JobUnschedulable`), instead of waiting out the Job's whole timeout, unless the cluster autoscaler is
adding a node for it (its newest event on the pod ``TriggeredScaleUp``, :func:`.pods.autoscaler_verdict`): then
the pod may wait ``timings.job_scale_up_grace``, and a later ``NotTriggerScaleUp`` (the scale-up failed, or no
node group it may grow fits) ends it with the autoscaler's message. The time the pod waited for a node does not
count against the Job's timeout (at most ``job_scale_up_grace`` of it). A container that cannot start
and will not by waiting (:data:`.pods.FATAL_WAITING_REASONS`: an image that cannot be pulled, a Secret or
ConfigMap its environment names that does not exist: ``CreateContainerConfigError``) ends it at once
(:class:`JobPodStuck`), as it ends a JobSet's launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from multislice import names
from multislice.backends.gke import jobset as jobsets
from multislice.backends.gke import pods as pod_state
from multislice.backends.gke.client import Kube
from multislice.errors import RunFailed


class JobUnschedulable(RunFailed):
    """A trainer Job's pod stayed Unschedulable past ``timings.job_unschedulable_grace`` (past
    ``timings.job_scale_up_grace`` while the cluster autoscaler was adding a node for it); the Job was deleted.

    The message quotes the scheduler (e.g. ``0/3 nodes are available: 3 Insufficient cpu.``) and the cluster
    autoscaler's newest event on the pod, when it wrote one.
    """


class JobPodStuck(RunFailed):
    """A trainer Job's container cannot start (:data:`multislice.backends.gke.pods.FATAL_WAITING_REASONS`); the Job
    was deleted. The message quotes the kubelet (e.g. ``CreateContainerConfigError: secret "x" not found``)."""


def _job_dict(kube: Kube, name: str) -> dict[str, Any]:
    """The Job ``name`` as the API's JSON (a V1Job serialises to a dict; the client annotates every JSON type)."""
    job = kube.call(kube.batch.read_namespaced_job, name, kube.namespace, what=f"get Job {name}")
    return cast(dict[str, Any], kube.api.sanitize_for_serialization(job))


def job_state(job: dict[str, Any]) -> str | None:
    """``Complete`` or ``Failed`` once the Job has that condition, else None."""
    for cond in job.get("status", {}).get("conditions", []) or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"]
    return None


def run_job(
    kube: Kube,
    body: dict[str, Any],
    *,
    timeout: float,
    on_progress: Callable[[str], None],
    what: str,
    until: Callable[[str], Any] | None = None,
) -> tuple[str, str, str | None]:
    """Create (or adopt) a Job, wait until it finishes (or, with ``until``, until its running pod's log has what
    ``until`` looks for), and read its pod's log.

    Args:
        kube: The API client.
        body: The Job manifest (its container is named ``names.TRAINER_CONTAINER``).
        timeout: Seconds to wait for ``Complete`` or ``Failed`` (or ``until``).
        on_progress: Called with progress lines.
        what: What the Job is, for messages (``verifier Job``).
        until: Called with the log of the Job's pod once it runs, at each poll; a result other than None ends the
            wait with the Job still running (state ``Running``): the verify step reads the verification of a
            Job that goes on to export (:mod:`multislice.trainer.verify_export`).

    Returns:
        ``(state, log, pod name)``: ``Complete``, ``Failed`` or (``until``) ``Running``, the container's log ('' when
        no pod was found), and the pod's name or None.

    Raises:
        TimeoutError: not finished within ``timeout`` seconds (the Job was deleted, so nothing runs on).
        JobUnschedulable: its pod stayed Unschedulable for ``kube.timings.job_unschedulable_grace`` seconds, or
            ``job_scale_up_grace`` while the cluster autoscaler was adding a node for it (the Job was deleted); the
            message has the scheduler's reason and the autoscaler's.
        JobPodStuck: its container cannot start (a missing Secret, an image that cannot be pulled; the Job was
            deleted); the message has the kubelet's reason.
        multislice.backends.gke.jobset.JobSetConflict: a Job of that name with another spec exists.
    """
    body = jobsets.with_spec_hash(body)
    name = body["metadata"]["name"]
    try:
        return _run_job(kube, body, name, timeout, on_progress, what, until)
    except KeyboardInterrupt:  # cancelled (multislice.cancel.Cancelled): the Job, created or not, goes too
        _delete(kube, name, (body["metadata"].get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID))
        raise


def _delete(kube: Kube, name: str, owner: str | None = None) -> bool:
    """Delete Job ``name`` (foreground) if it is pipeline run ``owner``'s (its ``pipeline/runid`` label; any with
    ``owner`` None), with a ``uid`` precondition on the Job read: another run's Job of that name, or one recreated
    since, is left. True when deleted."""
    try:
        job = kube.call(kube.batch.read_namespaced_job, name, kube.namespace, what=f"get Job {name}")
        if owner is not None and (job.metadata.labels or {}).get(names.LABEL_PIPELINE_RUN_ID) != owner:
            return False
        kube.call(
            kube.batch.delete_namespaced_job, name, kube.namespace,
            body=k8s.V1DeleteOptions(propagation_policy="Foreground",
                                     preconditions=k8s.V1Preconditions(uid=job.metadata.uid)),
            what=f"delete Job {name}",
        )  # fmt: skip
        return True
    except ApiException as error:
        if error.status == 404 or jobsets.precondition_failed(error):
            return False
        raise


def _pod_problems(kube: Kube, name: str) -> tuple[str | None, str | None, str | None]:
    """``(scheduler's message when the Job's newest pod is Unschedulable, its fatal waiting state, its name)``, each
    or None."""
    found = kube.call(
        kube.core.list_namespaced_pod, kube.namespace, label_selector=f"job-name={name}", what=f"list pods of {name}"
    )
    if not found.items:
        return None, None, None
    pod = found.items[-1]
    return pod_state.unschedulable(pod), pod_state.waiting_problem(pod), pod.metadata.name


def _running_log(kube: Kube, name: str) -> tuple[str, str | None]:
    """``(log, pod name)`` of Job ``name``'s newest pod once its container has started (phase ``Running``), else
    ``('', None)``: the API server refuses the log of a container that has not started (HTTP 400)."""
    found = kube.call(
        kube.core.list_namespaced_pod, kube.namespace, label_selector=f"job-name={name}", what=f"list pods of {name}"
    )
    if not found.items or (found.items[-1].status is None or found.items[-1].status.phase != "Running"):
        return "", None
    pod = found.items[-1].metadata.name
    try:
        log = kube.call(
            kube.core.read_namespaced_pod_log, pod, kube.namespace, container=names.TRAINER_CONTAINER,
            what=f"read log of {pod}",
        )  # fmt: skip
    except ApiException as error:
        if error.status in (400, 404):  # not started after all, or gone since the list
            return "", None
        raise
    return log, pod


def _run_job(
    kube: Kube,
    body: dict[str, Any],
    name: str,
    timeout: float,
    on_progress: Callable[[str], None],
    what: str,
    until: Callable[[str], Any] | None = None,
) -> tuple[str, str, str | None]:
    try:
        kube.call(kube.batch.create_namespaced_job, kube.namespace, body, what=f"create Job {name}")
        on_progress(f"{what} {name} created ({body['spec']['template']['spec']['containers'][0]['image']})")
    except ApiException as error:
        if error.status != 409:
            raise
        existing = _job_dict(kube, name)
        wanted = body["metadata"]["annotations"][jobsets.SPEC_HASH_ANNOTATION]
        jobsets.adopt_or_conflict("Job", existing, wanted, kube.namespace)
        on_progress(f"{what} {name} exists with the same spec; adopted")
    timings = kube.timings
    deadline = time.monotonic() + timeout
    unschedulable_since: float | None = None
    waited_before = 0.0  # seconds the Job's pods waited Unschedulable before the current wait
    told = None
    while True:
        job = _job_dict(kube, name)
        state = job_state(job)
        if state:
            break
        now = time.monotonic()
        waiting = now - unschedulable_since if unschedulable_since is not None else 0.0
        waited_for_node = min(waited_before + waiting, timings.job_scale_up_grace)
        if now > deadline + waited_for_node:  # the time spent waiting for a node is not the Job's to run
            _delete(kube, name, (body["metadata"].get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID))
            waited = f" (besides {waited_for_node:.0f} s waiting for a node)" if waited_for_node >= 1 else ""
            raise TimeoutError(f"{what} {name} still running after {timeout:.0f} s{waited}")
        if until is not None:
            log, pod = _running_log(kube, name)
            if pod is not None and until(log) is not None:
                return "Running", log, pod
        message, stuck, pod_name = _pod_problems(kube, name)
        if stuck is not None:
            _delete(kube, name)
            raise JobPodStuck(
                f"{what} {name}: its pod cannot start: {stuck} (the Job was deleted)",
                "a missing Secret: create it in the namespace (docs/gke-setup.md); an image that cannot be pulled: "
                "check images.trainer and that the nodes may pull it",
            )
        if message is None or pod_name is None:
            if unschedulable_since is not None:
                waited_before += now - unschedulable_since
            unschedulable_since = None
        else:
            unschedulable_since = unschedulable_since if unschedulable_since is not None else now
            autoscaler = pod_state.autoscaler_verdict(kube, pod_name)
            scaling_up = autoscaler is not None and autoscaler[0] == pod_state.SCALE_UP_TRIGGERED
            grace = timings.job_scale_up_grace if scaling_up else timings.job_unschedulable_grace
            if (message, autoscaler) != told:
                said = f"{what} {name}: pod Unschedulable: {message}"
                if autoscaler is not None:
                    said += f"; cluster autoscaler: {autoscaler[0]}: {autoscaler[1]}"
                if scaling_up:
                    said += f" (waiting up to {grace:.0f} s for the node, timeouts.scale_up_grace)"
                on_progress(said)
                told = (message, autoscaler)
            if now - unschedulable_since >= grace:
                _delete(kube, name, (body["metadata"].get("labels") or {}).get(names.LABEL_PIPELINE_RUN_ID))
                if scaling_up and autoscaler is not None:
                    why = (
                        f"; the cluster autoscaler was adding a node for it ({autoscaler[1]}) and it did not come "
                        f"within timeouts.scale_up_grace ({grace:.0f} s)"
                    )
                elif autoscaler is not None:
                    why = f"; cluster autoscaler: {autoscaler[1]}"
                else:
                    why = ""
                raise JobUnschedulable(
                    f"{what} {name}: its pod stayed Unschedulable for {now - unschedulable_since:.0f} s: {message}"
                    f"{why} (the Job was deleted)",
                    "raise timeouts.scale_up_grace if the node pool's nodes take longer to start; else check the "
                    "node pool's quota and the autoscaler's events (kubectl describe pod)"
                    if scaling_up
                    else "give the Job's pod a node that fits its requests: a CPU node pool with free capacity, or "
                    "autoscaling on one",
                )
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
