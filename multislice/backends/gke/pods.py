"""The pods of a JobSet: which is which, where they run, and why one cannot start or failed.

Pods are found by the labels JobSet puts on them (JobSet v0.12.0,
``api/jobset/v1alpha2/jobset_types.go``): ``jobset.sigs.k8s.io/jobset-name``,
``jobset.sigs.k8s.io/job-index`` (the slice), ``jobset.sigs.k8s.io/restart-attempt``
and the Job controller's ``batch.kubernetes.io/job-completion-index`` (the
host). Placement is read from ``spec.nodeName`` and the node's
``cloud.google.com/gke-nodepool`` label (GKE sets it on every node).

Failure causes read from pod status (core v1 ``ContainerStateWaiting.reason``,
``PodCondition`` ``PodScheduled``): image pulls (``ErrImagePull``,
``ImagePullBackOff``, ``InvalidImageName``), ``CrashLoopBackOff`` and
``CreateContainerConfigError`` fail at once; ``Unschedulable`` fails only
after a grace period, since the cluster autoscaler or a node pool being
created may still make room (the autoscaler's own verdict on a pod, its
``TriggeredScaleUp``/``NotTriggerScaleUp`` events: :func:`autoscaler_verdict`).
Messages quote the pod's events.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from multislice import names, tpu
from multislice.backends.gke.client import Kube

#: Container waiting reasons that will not resolve by waiting.
FATAL_WAITING_REASONS = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff", "CreateContainerConfigError"}
)
EVENT_LINES = 5


def _label(pod: Any, key: str) -> str | None:
    return (pod.metadata.labels or {}).get(key) or (pod.metadata.annotations or {}).get(key)


def slice_index(pod: Any) -> int:
    """The pod's slice (JobSet job index; a Ray worker's multi-host replica index, :mod:`.rayjob`)."""
    return int(_label(pod, names.JOB_INDEX_KEY) or _label(pod, "ray.io/worker-group-replica-index") or 0)


def host_index(pod: Any) -> int:
    """The pod's host within its slice (Job completion index; a Ray worker's ``ray.io/replica-host-index``)."""
    return int(_label(pod, names.JOB_COMPLETION_INDEX_KEY) or _label(pod, "ray.io/replica-host-index") or 0)


def attempt(pod: Any) -> int:
    """The JobSet restart attempt the pod belongs to."""
    return int(_label(pod, names.RESTART_ATTEMPT_KEY) or 0)


def list_pods(kube: Kube, jobset_name: str, restart_attempt: int | None = None) -> list[Any]:
    """Pods of the JobSet (``V1Pod``), optionally of one restart attempt, sorted by slice and host."""
    found = kube.call(
        kube.core.list_namespaced_pod, kube.namespace,
        label_selector=f"{names.JOBSET_NAME_KEY}={jobset_name}", what=f"list pods of JobSet {jobset_name}",
    )  # fmt: skip
    pods = [p for p in found.items if restart_attempt is None or attempt(p) == restart_attempt]
    return sorted(pods, key=lambda p: (attempt(p), slice_index(p), host_index(p)))


def leader(pods: list[Any]) -> Any | None:
    """Slice 0, host 0 of the newest restart attempt among ``pods``."""
    candidates = [p for p in pods if slice_index(p) == 0 and host_index(p) == 0]
    return max(candidates, key=attempt, default=None)


def _pod_events(kube: Kube, pod_name: str) -> list[Any] | None:
    """The pod's events (``CoreV1Event``) in the API's order, or None when they cannot be read."""
    try:
        found = kube.call(
            kube.core.list_namespaced_event, kube.namespace,
            field_selector=f"involvedObject.name={pod_name}", what=f"list events of pod {pod_name}",
        )  # fmt: skip
    except ApiException:
        return None
    return list(found.items)


def events(kube: Kube, pod_name: str, lines: int = EVENT_LINES) -> str:
    """The pod's last events as ``reason: message`` lines ('' when none or unreadable)."""
    items = (_pod_events(kube, pod_name) or [])[-lines:]
    return "\n".join(f"    {e.type or 'Normal'} {e.reason}: {e.message}" for e in items)


#: The cluster autoscaler's events on a pending pod after each scale-up attempt (type Normal, source
#: ``cluster-autoscaler``; kubernetes/autoscaler
#: ``cluster-autoscaler/processors/status/eventing_scale_up_processor.go``, ``EventingScaleUpStatusProcessor.Process``):
#: it is adding nodes for the pod ("pod triggered scale-up: [{<node group> 0->1 (max: 1)}]") ...
SCALE_UP_TRIGGERED = "TriggeredScaleUp"
#: ... or no node group it may grow would fit the pod ("pod didn't trigger scale-up: 1 Insufficient memory, 1 in
#: backoff after failed scale-up"; its reasons per node group, ``ReasonsMessage``).
SCALE_UP_NOT_TRIGGERED = "NotTriggerScaleUp"


def autoscaler_verdict(kube: Kube, pod_name: str) -> tuple[str, str] | None:
    """The cluster autoscaler's newest scale-up event on the pod: ``(reason, message)`` with reason
    :data:`SCALE_UP_TRIGGERED` or :data:`SCALE_UP_NOT_TRIGGERED`; None when it wrote none (no autoscaler, or it has
    not looked at the pod yet) or the events cannot be read.

    Newest by the event's ``lastTimestamp`` (a repeated event is one object whose count and ``lastTimestamp`` grow,
    client-go ``tools/record``), else ``eventTime``, ``firstTimestamp``, its creation; equal times keep the API's
    order (by name: ``<pod>.<creation time in hex nanoseconds>``).
    """
    found = _pod_events(kube, pod_name)
    if found is None:
        return None
    ours = [(i, e) for i, e in enumerate(found) if e.reason in (SCALE_UP_TRIGGERED, SCALE_UP_NOT_TRIGGERED)]
    if not ours:
        return None

    def when(item: tuple[int, Any]) -> tuple[float, int]:
        index, event = item
        stamp = event.last_timestamp or event.event_time or event.first_timestamp or event.metadata.creation_timestamp
        return (stamp.timestamp() if stamp is not None else 0.0, index)

    _, newest = max(ours, key=when)
    return newest.reason, newest.message or newest.reason


def waiting_problem(pod: Any) -> str | None:
    """``reason: message`` of a container stuck in a fatal waiting state, else None."""
    for status in (pod.status.container_statuses or []) + (pod.status.init_container_statuses or []):
        waiting = status.state.waiting if status.state else None
        if waiting and waiting.reason in FATAL_WAITING_REASONS:
            return f"container {status.name}: {waiting.reason}: {waiting.message or ''}".rstrip(": ")
    return None


def unschedulable(pod: Any) -> str | None:
    """The PodScheduled=False Unschedulable message, else None."""
    for cond in pod.status.conditions or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
            return cond.message or "Unschedulable"
    return None


def exit_code(pod: Any, container: str = names.TRAINER_CONTAINER) -> int | None:
    """Exit code of the trainer container's (or ``container``'s) last termination, if it terminated."""
    for status in pod.status.container_statuses or []:
        if status.name != container:
            continue
        for state in (status.state, status.last_state):
            if state and state.terminated:
                return state.terminated.exit_code
    return None


def attempt_failure(kube: Kube, jobset_name: str, restart_attempt: int) -> str:
    """Why restart attempt ``restart_attempt`` of the JobSet ended: its first failed pod, with the trainer
    container's exit code and termination reason (``OOMKilled``, ``Error``...).

    The JobSet controller deletes a failed attempt's Jobs when it restarts (kubernetes-sigs/jobset
    ``pkg/controllers/jobset_controller.go``, ``deleteJobs``), so the pods may be gone by the time the
    restart is seen: the text then says so.
    """
    failed = [p for p in list_pods(kube, jobset_name, restart_attempt)
              if p.status.phase == "Failed" or exit_code(p) not in (None, 0)]  # fmt: skip
    if not failed:
        return f"attempt {restart_attempt}: its pods were deleted before their exit could be read"
    pod = min(failed, key=lambda p: (slice_index(p), host_index(p)))
    reason = next((s.state.terminated.reason for s in pod.status.container_statuses or []
                   if s.name == names.TRAINER_CONTAINER and s.state and s.state.terminated
                   and s.state.terminated.reason), None)  # fmt: skip
    code = exit_code(pod)
    return (f"pod {pod.metadata.name} (slice {slice_index(pod)}, host {host_index(pod)}) "
            + (f"exited with code {code}" if code is not None else f"{pod.status.phase}")
            + (f" ({reason})" if reason else ""))  # fmt: skip


def in_place_failure(kube: Kube, jobset_name: str) -> str:
    """Why the JobSet last restarted in place: the pod whose trainer container's last termination
    (``lastState.terminated``, kept across in-place restarts: KEP-5532, "ContainerStatuses in API") finished first.
    The other pods' trainers were stopped after it, when their agents restarted them."""
    ended = []
    for pod in list_pods(kube, jobset_name):
        for status in pod.status.container_statuses or []:
            last = status.last_state.terminated if status.last_state else None
            if status.name == names.TRAINER_CONTAINER and last is not None:
                ended.append((last.finished_at.timestamp() if last.finished_at else float("inf"), pod, last))
    if not ended:
        return "no trainer container's last termination could be read"
    _, pod, last = min(ended, key=lambda item: item[0])
    reason = f" ({last.reason})" if last.reason else ""
    where = f"pod {pod.metadata.name} (slice {slice_index(pod)}, host {host_index(pod)})"
    return f"{where} exited with code {last.exit_code}{reason}; the pods restarted in place"


def placement(kube: Kube, pods: list[Any]) -> dict[str, dict[str, Any]]:
    """Pod name -> ``{"slice", "host", "node", "node_pool"}`` from each pod's node's labels."""
    pools: dict[str, str | None] = {}
    result = {}
    for pod in pods:
        node = pod.spec.node_name
        if node and node not in pools:
            found = kube.call(kube.core.read_node, node, what=f"get node {node}")
            pools[node] = (found.metadata.labels or {}).get(tpu.NODEPOOL_LABEL)
        result[pod.metadata.name] = {
            "slice": slice_index(pod), "host": host_index(pod), "node": node, "node_pool": pools.get(node),
        }  # fmt: skip
    return result


def exclusive_placement_problems(where: dict[str, dict[str, Any]]) -> list[str]:
    """Breaches of exclusive placement: a slice over several node pools, or two slices on one pool."""
    by_slice: dict[int, set[str | None]] = {}
    for info in where.values():
        by_slice.setdefault(info["slice"], set()).add(info["node_pool"])
    problems = []
    owner: dict[str | None, int] = {}
    for index, pools in sorted(by_slice.items()):
        if len(pools) != 1 or None in pools:
            problems.append(f"slice {index} runs on node pools {sorted(map(str, pools))}, not exactly one")
        for pool in pools:
            if pool in owner:
                problems.append(f"slices {owner[pool]} and {index} share node pool {pool}")
            owner[pool] = index
    return problems
