# ruff: noqa: F811  (the GKE scenarios' pytest fixtures are imported, and named again as parameters)
"""Elastic training on the GKE backend, over real HTTP against the suite's Kubernetes emulator, under the RBAC
``multislice render`` writes.

The scripts play GKE (nodes, Spot preemption: the termination taint, the node deleted, the pods' disruption
condition), Kueue (the ClusterQueue's quota and reservation, admitting the relaunched JobSet) and the JobSet
controller. The resize controller's watch (:class:`multislice.elastic.controller.Watch`) decides, through
:func:`multislice.elastic.policy.decide`; the backend detects, follows, interrupts and relaunches. Each change is waited
on through what the backend told or read, never a sleep.
"""

from __future__ import annotations

import threading

import pytest
from kubernetes.client.exceptions import ApiException

from multislice import names, storage
from multislice.backends.gke import GkeBackend
from multislice.backends.gke import elastic as gke_elastic
from multislice.backends.gke.client import KUEUE_GROUP, KUEUE_VERSION
from multislice.elastic.controller import Watch
from tests.backends.gke.harness import POOLS, RUN_ID
from tests.kube_cluster import wait_until
from tests.kube_controllers import step_line

CHIPS = 16  # a v6e-16 slice

# The GKE scenarios' fixtures this module's tests all take (tests/backends/gke/conftest.py).
pytestmark = pytest.mark.usefixtures("crd_schemas", "least_privilege", "node_pools", "run_storage")


def elastic_stage(plan):
    return next(stage for stage in plan.stages if stage.elastic)


def cluster_queue(play, plan, nominal_slices: int, reserved_slices: int) -> None:
    """The run's ClusterQueue with ``nominal_slices`` of TPU quota, ``reserved_slices`` of it held."""
    body = {
        "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "ClusterQueue",
        "metadata": {"name": plan.spec.cluster_queue},
        "spec": {"resourceGroups": [{"coveredResources": ["google.com/tpu"], "flavors": [
            {"name": plan.spec.slice_type.flavor_name,
             "resources": [{"name": "google.com/tpu", "nominalQuota": nominal_slices * CHIPS}]}]}]},
    }  # fmt: skip
    status = {
        "flavorsReservation": [
            {
                "name": plan.spec.slice_type.flavor_name,
                "resources": [{"name": "google.com/tpu", "total": reserved_slices * CHIPS}],
            }
        ]
    }
    try:
        play.custom.create_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", body)
    except ApiException as error:  # already there: only its status changes
        if error.status != 409:
            raise
    play.custom.patch_cluster_custom_object_status(
        KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", plan.spec.cluster_queue, {"status": status}
    )


def launched(served, play, plan, stage, slices: int = 2, attempt: int = 0):
    """The stage's JobSet created by the backend, admitted, its pods Running on the first ``slices`` pools."""
    backend = GkeBackend(served.kube())
    target_plan, target_stage = plan.on_slices(stage, slices)
    backend.submit(backend.workload_manifest(target_plan, target_stage, RUN_ID))
    play.kueue_queues(stage.jobset, "waiting")
    play.kueue_admits(stage.jobset)
    play.pods(stage.jobset, slices, plan.slice.hosts, attempt=attempt, pools=POOLS[:slices])
    return backend


def preempt_spot(play, plan, jobset: str, slice_index: int, attempt: int = 0) -> None:
    """GKE reclaims the Spot VMs of slice ``slice_index``: termination taint, pods disrupted, nodes deleted."""
    pool = POOLS[slice_index]
    for host in range(plan.slice.hosts):
        node = f"gke-{pool}-{host}"
        if node not in {n.metadata.name for n in play.core.list_node().items}:
            continue  # already gone
        play.core.patch_node(node, {"spec": {"taints": [
            {"key": "cloud.google.com/impending-node-termination", "effect": "NoSchedule"}]}})  # fmt: skip
        play.core.delete_node(node)
    for host in range(plan.slice.hosts):
        play.pod_status(
            play.pod_name(jobset, slice_index, host, attempt),
            {"phase": "Failed", "reason": "Terminated", "message": "Pod was terminated in response to imminent node "
             "shutdown.", "conditions": [{"type": "DisruptionTarget", "status": "True",
                                          "reason": "TerminationByKubelet", "message": "node shutdown"}]},
        )  # fmt: skip


def restore_pool(play, plan, slice_index: int) -> None:
    play.nodes({POOLS[slice_index]: plan.slice.hosts})


def delete_old_pods(play, jobset: str) -> None:
    """The garbage collector: the deleted JobSet's pods and its Kueue Workload go (foreground deletion)."""
    try:
        play.custom.delete_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, play.ns, "workloads",
                                                    play.workload_name(jobset))  # fmt: skip
    except ApiException as error:
        if error.status != 404:  # already collected
            raise
    for pod in play.core.list_namespaced_pod(play.ns, label_selector=f"jobset.sigs.k8s.io/jobset-name={jobset}").items:
        play.core.delete_namespaced_pod(pod.metadata.name, play.ns)


def test_lost_slice_signals(served, play, plan):
    """Each signal names the slice: a healthy JobSet has none; a Spot reclaim, a node deleted, a node NotReady."""
    stage = elastic_stage(plan)
    cluster_queue(play, plan, nominal_slices=2, reserved_slices=2)
    backend = launched(served, play, plan, stage)
    assert backend.lost_slice(stage.jobset) is None
    assert backend.available_slices(plan) == 2  # its own reservation counts as the run's
    play.core.patch_node_status(
        f"gke-{POOLS[0]}-1", {"status": {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeLost"}]}}
    )
    lost = backend.lost_slice(stage.jobset)
    assert lost.startswith("slice 0 (pod ") and "is NotReady (NodeLost)" in lost
    assert backend.available_slices(plan) == 1
    play.core.patch_node_status(f"gke-{POOLS[0]}-1", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert backend.lost_slice(stage.jobset) is None
    play.core.delete_node(f"gke-{POOLS[1]}-2")
    assert "its node was deleted" in backend.lost_slice(stage.jobset)
    preempt_spot(play, plan, stage.jobset, 1)
    lost = backend.lost_slice(stage.jobset)
    assert lost.startswith("slice 1 (pod ") and "TerminationByKubelet" in lost
    assert backend.available_slices(plan) == 1


def test_available_slices_from_the_cluster_queue(served, play, plan):
    """Kueue's free quota (nominal minus others' reservation, the run's own counted free) caps the pools."""
    stage = elastic_stage(plan)
    backend = GkeBackend(served.kube())
    cluster_queue(play, plan, nominal_slices=2, reserved_slices=1)  # another workload holds one slice
    assert gke_elastic.available(backend.kube, plan, stage.jobset) == 1
    cluster_queue(play, plan, nominal_slices=2, reserved_slices=0)
    assert gke_elastic.available(backend.kube, plan, stage.jobset) == 2
    play.core.delete_node(f"gke-{POOLS[1]}-0")
    assert gke_elastic.available(backend.kube, plan, stage.jobset) == 1


class Follow:
    """``backend.follow`` of the stage in a thread, with the train step's elastic watch as its interrupt."""

    def __init__(self, backend, plan, stage, running: int, wait_seconds: float):
        self.told: list[str] = []
        self.records: list[dict] = []
        self.watch = Watch(
            plan, stage, backend, running, stage.runnable_counts(), wait_seconds, self.tell, self.records
        )
        target_plan, target_stage = plan.on_slices(stage, running)
        self.result = None
        self.thread = threading.Thread(target=self.run, args=(backend, target_plan, target_stage), daemon=True)
        self.thread.start()

    def tell(self, line: str) -> None:
        self.told.append(line)

    def run(self, backend, plan, stage) -> None:
        def on_line(line):
            if "completed step" in line:
                step = int(line.split("completed step: ")[1].split(",")[0])
                self.records.append({"step": step, "learning/loss": 1.0})

        self.result = backend.follow(plan, stage, on_line, self.tell, interrupt=self.watch.interrupt)

    def finished(self):
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()
        return self.result


def relaunch_admitted(backend, play, plan, stage, slices: int, told: list[str], collect: bool = False) -> None:
    """``backend.relaunch`` on ``slices``, Kueue admitting the new JobSet once it exists.

    With ``collect``, the garbage collector's part (:func:`delete_old_pods`) is played once the new JobSet
    exists, so the old JobSet's deletion is never missed: the emulator deletes at once, and ``relaunch``
    creates the new JobSet of the same name a moment later.
    """
    new_plan, new_stage = plan.on_slices(stage, slices)
    thread = threading.Thread(target=backend.relaunch, args=(new_plan, new_stage, told.append), daemon=True)
    thread.start()
    wait_until(lambda: any("waiting for Kueue" in line for line in told), what="the relaunched JobSet")
    if collect:
        delete_old_pods(play, stage.jobset)
    play.kueue_queues(stage.jobset, "waiting")
    play.kueue_admits(stage.jobset)
    thread.join(timeout=120)
    assert not thread.is_alive()


def test_shrink_after_spot_preemption_then_grow_back(served, play, plan):
    """2 slices; Spot reclaims slice 1 and no capacity returns (wait 0 s): the JobSet is relaunched on 1 slice,
    gradient accumulation doubled, re-admitted by Kueue; the pool and the quota come back and a checkpoint
    commits: it grows back to 2."""
    stage = elastic_stage(plan)
    stage = stage.model_copy(update={"wait_for_lost_slice_seconds": 0.0})
    cluster_queue(play, plan, nominal_slices=2, reserved_slices=2)
    backend = launched(served, play, plan, stage)
    play.log(play.pod_name(stage.jobset, 0, 0), step_line(0, 3.0) + step_line(1, 2.9))
    follow = Follow(backend, plan, stage, running=2, wait_seconds=0.0)
    wait_until(lambda: len(follow.records) == 2, what="the step lines")
    preempt_spot(play, plan, stage.jobset, 1)
    cluster_queue(play, plan, nominal_slices=1, reserved_slices=2)  # the Spot quota went with the VMs
    delete_old_pods_when_gone = threading.Thread(
        target=lambda: (wait_until(lambda: backend.kube.get_jobset(stage.jobset) is None, what="deletion"),
                        delete_old_pods(play, stage.jobset)), daemon=True)  # fmt: skip
    delete_old_pods_when_gone.start()
    finished = follow.finished()
    assert finished.phase == "Interrupted"
    lost = [line for line in follow.told if line.startswith("slice lost: slice 1 (pod ")]
    # the first signal seen: the termination taint, the node deleted, or the pods' disruption condition
    assert lost and any(
        w in lost[0] for w in ("impending-node-termination", "node was deleted", "TerminationByKubelet")
    )
    assert follow.watch.decision.slices == 1 and follow.watch.decision.action == "relaunch"
    delete_old_pods_when_gone.join(timeout=60)

    told: list[str] = []
    relaunch_admitted(backend, play, plan, stage, 1, told)
    js = backend.kube.get_jobset(stage.jobset)
    assert js["spec"]["replicatedJobs"][0]["replicas"] == 1
    assert "gradient_accumulation_steps=2" in str(js["spec"])
    assert js["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID] == RUN_ID
    assert f"JobSet {stage.jobset} admitted on 1 slice(s)" in told[-1]

    # Grow back: the pool returns, the quota frees, a checkpoint commits after it.
    play.pods(stage.jobset, 1, plan.slice.hosts, pools=POOLS[:1])
    cluster_queue(play, plan, nominal_slices=2, reserved_slices=1)
    follow = Follow(backend, plan, stage, running=1, wait_seconds=0.0)
    assert backend.available_slices(plan) == 1  # the pool's nodes are still gone
    restore_pool(play, plan, 1)
    wait_until(lambda: any("capacity for 2 slice(s) available" in line for line in follow.told), what="capacity")
    storage.write_text(f"{stage.checkpoint_dir.rstrip('/')}/5/{storage.COMMIT_FILE}", "ok")
    play.log(play.pod_name(stage.jobset, 0, 0), step_line(5, 2.5))
    assert follow.finished().phase == "Interrupted"
    assert follow.watch.decision.slices == 2


def test_wait_then_shrink(served, play, plan):
    """A slice lost and no capacity for 2 slices returns within ``wait_for_lost_slice_seconds`` (2 s): the watch
    waits, telling so, and only then relaunches on 1 slice."""
    stage = elastic_stage(plan)
    cluster_queue(play, plan, nominal_slices=2, reserved_slices=2)
    backend = launched(served, play, plan, stage)
    follow = Follow(backend, plan, stage, running=2, wait_seconds=2.0)
    preempt_spot(play, plan, stage.jobset, 1)
    cluster_queue(play, plan, nominal_slices=1, reserved_slices=2)
    finished = follow.finished()
    assert finished.phase == "Interrupted"
    waited = [line for line in follow.told if "waiting up to 2 s for its capacity" in line]
    assert waited and follow.told.index(waited[0]) < len(follow.told)
    decision = follow.watch.decision
    assert (decision.action, decision.slices) == ("relaunch", 1)
    assert follow.watch.detected == follow.watch.lost_at  # the resize's cost counts from the loss
    assert backend.kube.get_jobset(stage.jobset) is None  # deleted before the relaunch


def test_preemption_during_a_resize(served, play, plan):
    """Growing back from 1 to 2 slices: the new JobSet is admitted, then slice 1's Spot nodes are reclaimed
    before its pods are scheduled. Its pods stay Unschedulable: the slice is lost again and, with capacity for
    1 slice only, the stage shrinks back to 1 slice."""
    stage = elastic_stage(plan)
    cluster_queue(play, plan, nominal_slices=2, reserved_slices=1)
    backend = launched(served, play, plan, stage, slices=1)
    told: list[str] = []
    relaunch_admitted(backend, play, plan, stage, 2, told, collect=True)
    assert backend.kube.get_jobset(stage.jobset)["spec"]["replicatedJobs"][0]["replicas"] == 2
    # Reclaimed during the resize: slice 1's nodes go, its new pods cannot be scheduled.
    for host in range(plan.slice.hosts):
        play.core.delete_node(f"gke-{POOLS[1]}-{host}")
    cluster_queue(play, plan, nominal_slices=1, reserved_slices=2)
    play.pods(stage.jobset, 1, plan.slice.hosts, pools=POOLS[:1])
    unschedulable = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                     "reason": "Unschedulable", "message": "0/4 nodes are available: node affinity"}]}  # fmt: skip
    for host in range(plan.slice.hosts):
        body = {"metadata": {"name": play.pod_name(stage.jobset, 1, host), "labels": {
            "jobset.sigs.k8s.io/jobset-name": stage.jobset, "jobset.sigs.k8s.io/job-index": "1",
            "jobset.sigs.k8s.io/restart-attempt": "0", "batch.kubernetes.io/job-completion-index": str(host)}},
            "spec": {"containers": [{"name": "trainer", "image": "trainer"}]}, "status": unschedulable}  # fmt: skip
        play.core.create_namespaced_pod(play.ns, body)
    follow = Follow(backend, plan, stage, running=2, wait_seconds=0.0)
    assert follow.finished().phase == "Interrupted"
    lost = [line for line in follow.told if line.startswith("slice lost: slice 1 (pod ")]
    assert lost and "Unschedulable: 0/4 nodes are available" in lost[0]
    assert follow.watch.decision.slices == 1
