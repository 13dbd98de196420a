"""admit's and launch's waits on GKE are woken by watch events, with API reads bounded by the changes.

The steps run with a poll interval of 10 ms and watch requests and progress reports of a minute: a step that
polled would read the API hundreds of times while the controller script makes its changes; one that waits on
watch events reads it once per list and per change it must look at (the emulator counts the GET requests of the
pipeline's ServiceAccount, :meth:`tests.kube_cluster.Cluster.reads`). Each change is made after the step has
told (or the emulator has sent the watch event showing) that it saw the previous one.
"""

from __future__ import annotations

import dataclasses

import pytest

from multislice.backends.gke import GkeBackend
from multislice.backends.gke.client import KUEUE_GROUP, KUEUE_VERSION, WORKLOAD_PLURAL
from multislice.steps import admit, launch
from tests.backends.gke.harness import POOLS, RUN_ID, Background, stage_of
from tests.kube_cluster import FAST, wait_until

pytestmark = pytest.mark.usefixtures("crd_schemas", "least_privilege", "run_storage", "node_pools")

#: No poll could go unnoticed: 10 ms between polls; watch requests, reports and the grace last a minute.
EVENTS_ONLY = dataclasses.replace(FAST, poll_seconds=0.01, watch_seconds=60, report_seconds=60, unschedulable_grace=120)


def pending_message(play, jobset: str, message: str) -> None:
    """Kueue rewrites the Workload's pending condition (a new reason to wait: the quota it lacks changed)."""
    condition = {"type": "QuotaReserved", "status": "False", "reason": "Pending", "message": message}
    play.custom.patch_namespaced_custom_object_status(
        KUEUE_GROUP, KUEUE_VERSION, play.ns, WORKLOAD_PLURAL, play.workload_name(jobset),
        {"status": {"conditions": [condition]}},
    )  # fmt: skip


def test_admit_is_woken_by_kueues_updates_and_reads_nothing_per_update(served, play, plan, told):
    js, user = stage_of(plan).jobset, served.user
    counted = {}

    def kueue():
        play.kueue_queues(js, "insufficient quota 0")
        told.wait_for(r"waiting for admission \(\d+ s\): .*insufficient quota 0")
        counted["waiting"] = served.cluster.reads(user)
        for change in range(1, 6):
            pending_message(play, js, f"insufficient quota {change}")
            told.wait_for(rf"waiting for admission \(\d+ s\): .*insufficient quota {change}")
        counted["updated"] = served.cluster.reads(user)
        play.kueue_admits(js)

    with Background(kueue, told):
        report = admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(served.kube(timings=EVENTS_ONLY)))
    assert report.admitted and report.cluster_queue
    # Five Workload updates, each told from the watch event's object: not one GET or LIST for them.
    assert counted["updated"] == counted["waiting"]


def test_launch_is_woken_by_pod_events_and_reads_per_event_not_per_interval(served, play, plan, told):
    js, user = stage_of(plan).jobset, served.user
    backend = GkeBackend(served.kube(timings=EVENTS_ONLY))

    def kueue():
        play.kueue_queues(js, "waiting")
        play.kueue_admits(js)

    with Background(kueue, told):
        admitted = admit.run(plan, stage_of(plan), RUN_ID, backend=backend)
    names = play.pods(js, 2, plan.slice.hosts, phase="Pending")
    counted = {}
    pod_watches = lambda: sum(1 for plural, _ in served.cluster.watch_starts if plural == "pods")  # noqa: E731
    watches_before = pod_watches()

    def kubelet():
        told.wait_for(rf"0/{len(names)} pods Running")
        counted["reads"], counted["events"] = served.cluster.reads(user), len(served.cluster.delivered)
        # Having looked once, the step waits on a watch of the pods and reads nothing more until an event: a step
        # that polled (every 10 ms here) would never open that watch, and would read on instead.
        wait_until(lambda: pod_watches() > watches_before, what="the launch step's watch of the pods")
        counted["quiet"] = served.cluster.reads(user) - counted["reads"]
        for index, name in enumerate(names):
            play.pod_scheduled(name, f"gke-{POOLS[index // plan.slice.hosts]}-{index % plan.slice.hosts}")

    with Background(kubelet, told):
        report = launch.run(plan, stage_of(plan), admitted, backend=backend)
    assert report.pods == len(names)
    assert counted["quiet"] == 0
    events = sum(1 for plural, _ in served.cluster.delivered[counted["events"] :] if plural == "pods")
    reads = served.cluster.reads(user) - counted["reads"]
    # One look per watch event at most (a GET of the JobSet and a LIST of its pods), then the placement's GET of
    # each pod's node; the JobSet's Lease is renewed every 200 s, not within this test.
    assert events <= 2 * len(names) and reads <= 2 * events + len(names), (reads, events)
