"""Elastic training on GKE: which slice of a JobSet was lost, and how many slices the cluster can take now.

A slice is lost when a pod of the JobSet's current restart attempt failed or
was disrupted, or when its node went. The signals read, with their sources:

- pod ``status.phase`` ``Failed``; pod ``status.reason`` ``NodeShutdown`` /
  ``Terminated`` / ``Shutdown`` (the kubelet's graceful node shutdown, which
  GKE Spot and preemptible VMs trigger on their termination notice:
  kubernetes.io/docs/concepts/cluster-administration/node-shutdown/ and
  cloud.google.com/kubernetes-engine/docs/concepts/spot-vms);
- the pod condition ``DisruptionTarget`` True, with its reason
  (``DeletionByPodGC``: its node was deleted; ``TerminationByKubelet``,
  ``DeletionByTaintManager``, ``PreemptionByScheduler``,
  ``EvictionByEvictionAPI``: kubernetes.io/docs/concepts/workloads/pods/disruptions/
  "Pod disruption conditions");
- the pod's node (``spec.nodeName``) deleted (node-pool repair and Spot
  reclaim delete the node), its ``Ready`` condition not True (``NodeNotReady``),
  or its taints: ``cloud.google.com/impending-node-termination`` (GKE, a Spot
  VM's termination notice), ``node.kubernetes.io/unreachable``,
  ``node.kubernetes.io/not-ready``, ``node.kubernetes.io/unschedulable``;
- a pod of the attempt ``Unschedulable`` (its slice's nodes are gone and the
  JobSet's restart waits for capacity).

Pods map to slices with JobSet's ``jobset.sigs.k8s.io/job-index`` label
(:func:`.pods.slice_index`).

The capacity (:func:`available`) is approximated from two reads: the
ClusterQueue's nominal ``google.com/tpu`` quota minus what other workloads hold
(``status.flavorsReservation``, the run's own Workload added back when it holds
quota), and the run's node pools with every host node ready. Not modelled:
borrowing from a cohort, preemption of lower-priority workloads by Kueue,
node-pool autoscaling from zero (a Spot pool scaled to zero counts as no
capacity until its nodes are back), and flex-start ProvisioningRequests.
"""

from __future__ import annotations

from typing import Any

from kubernetes.client.exceptions import ApiException

from multislice import tpu
from multislice.backends.gke import jobset, pods, workload
from multislice.backends.gke.client import KUEUE_GROUP, KUEUE_VERSION, Kube
from multislice.plan import Plan

#: Pod ``status.reason`` values of a pod stopped by its node going (kubelet graceful node shutdown).
NODE_GONE_REASONS = frozenset({"NodeShutdown", "Terminated", "Shutdown", "NodeLost", "UnexpectedAdmissionError"})
#: Node taints meaning the node is going or gone (GKE's Spot termination notice, the node lifecycle controller).
LOST_TAINTS = frozenset(
    {
        "cloud.google.com/impending-node-termination",
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unschedulable",
    }
)


def node_problem(node: Any | None) -> str | None:
    """Why ``node`` (a ``V1Node``, None when deleted) cannot run a slice's host, or None when it can."""
    if node is None:
        return "its node was deleted (Spot reclaim or node-pool repair)"
    if node.spec is not None and node.spec.unschedulable:
        return f"node {node.metadata.name} is cordoned"
    for taint in (node.spec.taints if node.spec is not None else None) or []:
        if taint.key in LOST_TAINTS:
            return f"node {node.metadata.name} has taint {taint.key}"
    for condition in (node.status.conditions if node.status is not None else None) or []:
        if condition.type == "Ready" and condition.status != "True":
            return f"node {node.metadata.name} is NotReady ({condition.reason or condition.status})"
    return None


def pod_problem(pod: Any, node_of: dict[str, Any]) -> str | None:
    """Why ``pod`` shows its slice lost, or None. ``node_of`` maps node names to nodes (missing: deleted)."""
    status = pod.status
    for condition in status.conditions or []:
        if condition.type == "DisruptionTarget" and condition.status == "True":
            return f"disrupted ({condition.reason}: {condition.message or ''})".replace(": )", ")")
    if status.reason in NODE_GONE_REASONS:
        return f"stopped by its node ({status.reason}: {status.message or ''})".replace(": )", ")")
    if status.phase == "Failed":
        return f"failed ({status.reason or 'exit code ' + str(pods.exit_code(pod))})"
    name = pod.spec.node_name if pod.spec is not None else None
    if name:
        return node_problem(node_of.get(name))
    message = pods.unschedulable(pod)
    if message:
        return f"Unschedulable: {message}"
    return None


def _nodes(kube: Kube) -> dict[str, Any]:
    found = kube.call(kube.core.list_node, what="list nodes")
    return {node.metadata.name: node for node in found.items}


def lost_slice(kube: Kube, name: str) -> str | None:
    """Why JobSet ``name`` lost a slice (the first lost slice's first pod, with the cause), or None.

    Reads the JobSet, the pods of its current restart attempt and the nodes.
    """
    js = kube.get_jobset(name)
    if js is None or jobset.phase(js) in ("Completed", "Failed", "Suspended"):
        return None
    current = pods.list_pods(kube, name, jobset.restarts(js))
    if not current:
        return None
    node_of = _nodes(kube)
    for pod in current:
        problem = pod_problem(pod, node_of)
        if problem:
            return f"slice {pods.slice_index(pod)} (pod {pod.metadata.name}): {problem}"
    return None


def ready_pools(kube: Kube, plan: Plan) -> int:
    """Node pools of the plan's slice shape (accelerator and topology labels) with ``hosts`` ready nodes each."""
    shape = plan.slice
    counts: dict[str, int] = {}
    for node in _nodes(kube).values():
        labels = node.metadata.labels or {}
        if (
            labels.get(tpu.ACCELERATOR_LABEL) != shape.gke_accelerator
            or labels.get(tpu.TOPOLOGY_LABEL) != shape.topology
        ):
            continue
        if node_problem(node) is None:
            pool = labels.get(tpu.NODEPOOL_LABEL, "")
            counts[pool] = counts.get(pool, 0) + 1
    return sum(1 for count in counts.values() if count >= shape.hosts)


def _tpu_quantity(value: Any) -> int:
    return int(str(value)) if value is not None else 0


def admissible_slices(kube: Kube, plan: Plan, own: dict[str, Any] | None) -> int | None:
    """Slices the ClusterQueue's ``google.com/tpu`` nominal quota holds beside the other workloads; None unreadable.

    ``own`` is the run's JobSet: when its Workload holds quota, its reservation is counted as free.
    Source: Kueue v1beta1 ClusterQueue ``spec.resourceGroups[].flavors[].resources[].nominalQuota`` and
    ``status.flavorsReservation[].resources[].total``.
    """
    try:
        cq = kube.call(
            kube.custom.get_cluster_custom_object, KUEUE_GROUP, KUEUE_VERSION, "clusterqueues",
            plan.spec.cluster_queue, what=f"get ClusterQueue {plan.spec.cluster_queue}",
        )  # fmt: skip
    except ApiException as error:
        if error.status in (403, 404):
            return None
        raise
    nominal = reserved = 0
    for group in cq.get("spec", {}).get("resourceGroups", []):
        for flavor in group.get("flavors", []):
            for resource in flavor.get("resources", []):
                if resource.get("name") == tpu.TPU_RESOURCE:
                    nominal += _tpu_quantity(resource.get("nominalQuota"))
    for flavor in cq.get("status", {}).get("flavorsReservation", []):
        for resource in flavor.get("resources", []):
            if resource.get("name") == tpu.TPU_RESOURCE:
                reserved += _tpu_quantity(resource.get("total"))
    if own is not None:
        found = workload.find(kube, own)
        conditions = {c.get("type"): c.get("status") for c in ((found or {}).get("status") or {}).get("conditions", [])}
        if conditions.get("QuotaReserved") == "True":
            reserved -= jobset.replicas(own) * plan.slice.chips
    return max(0, nominal - max(0, reserved)) // plan.slice.chips


def available(kube: Kube, plan: Plan, jobset_name: str) -> int:
    """Slices the run can have now: the fewer of what Kueue can admit and the node pools ready for a slice."""
    pools = ready_pools(kube, plan)
    admissible = admissible_slices(kube, plan, kube.get_jobset(jobset_name) if jobset_name else None)
    return pools if admissible is None else min(pools, admissible)
