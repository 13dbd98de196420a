"""A trainer Job's pod on an autoscaled CPU node pool (multislice/backends/gke/jobs.py), over real HTTP.

The verify-and-export Job of a stage with ``export`` (its ``export-highmem`` pool autoscales from zero: an M3 node
takes minutes) waits while the cluster autoscaler says it is adding a node for the pod (``TriggeredScaleUp``), and
ends early, quoting the autoscaler, when it says it cannot (``NotTriggerScaleUp``) or says nothing. The autoscaler's
events are played as kubernetes/autoscaler writes them (:meth:`tests.kube_controllers.Play.autoscaler_event`).
"""

from __future__ import annotations

import dataclasses

import pytest

from multislice import config, reports, timings
from multislice.backends.gke import GkeBackend, aot, exporter, jobs
from multislice.backends.gke import data_workers as gke_workers
from multislice.plan import make_plan
from multislice.preflight import request_for
from multislice.steps import verify_checkpoint
from tests.backends.gke.harness import RUN_ID, Background, stage_of
from tests.kube_cluster import FAST
from tests.kube_controllers import verification_line

pytestmark = pytest.mark.usefixtures("crd_schemas", "least_privilege", "run_storage", "node_pools")

#: ``ScaleUpInfo`` of the export pool's node group growing from 0 to 1 (``{<group> <current>-><new> (max: <max>)}``).
SCALE_UP = "[{https://www.googleapis.com/compute/v1/projects/p/zones/us-east5-b/instanceGroups/gke-c-export-highmem-1 0->1 (max: 1)}]"  # noqa: E501
SCHEDULER = "0/8 nodes are available: 8 node(s) didn't match Pod's node affinity/selector."
UNSCHEDULABLE = {"phase": "Pending", "conditions": [
    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": SCHEDULER}]}  # fmt: skip


def trained(plan) -> None:
    """The stage's train report, which the verify step reads first."""
    reports.write(plan, reports.TrainReport(jobset=stage_of(plan).jobset, final_loss=5.0, final_eval_loss=5.25),
                  stage_of(plan))  # fmt: skip


def test_a_pod_the_autoscaler_adds_a_node_for_waits_past_the_short_grace_and_runs(served, play, plan, told):
    """No grace at all without the autoscaler (``job_unschedulable_grace`` 0): the Job lives on only because the
    autoscaler's newest event on its pod is TriggeredScaleUp; once the node is there the pod runs and verifies."""
    waits = dataclasses.replace(FAST, job_unschedulable_grace=0, job_scale_up_grace=120)
    stage, name = stage_of(plan), exporter.job_name(stage_of(plan))
    trained(plan)

    def autoscaler_adds_a_node():
        _, pod = play.job_pod(name)
        play.autoscaler_event(pod, triggered=True, detail=SCALE_UP)
        play.pod_status(pod, UNSCHEDULABLE)
        told.wait_for(r"pod Unschedulable: .*; cluster autoscaler: TriggeredScaleUp: pod triggered scale-up: "
                      r".*export-highmem.* \(waiting up to 120 s for the node, timeouts.scale_up_grace\)")  # fmt: skip
        play.pod_scheduled(pod, "gke-export-highmem-0")
        play.log(pod, verification_line())

    with Background(autoscaler_adds_a_node, told):
        verified = verify_checkpoint.run(plan, stage, RUN_ID, backend=GkeBackend(served.kube(timings=waits)))
    assert (verified.verdict, verified.job) == ("PASS", name)


def test_the_autoscaler_saying_it_cannot_ends_the_job_with_its_message(served, play, plan, told):
    stage, name = stage_of(plan), exporter.job_name(stage_of(plan))
    trained(plan)

    def autoscaler_cannot():
        _, pod = play.job_pod(name)
        play.autoscaler_event(pod, triggered=False, detail="1 Insufficient memory")
        play.pod_status(pod, UNSCHEDULABLE)

    with Background(autoscaler_cannot), pytest.raises(jobs.JobUnschedulable) as failed:
        verify_checkpoint.run(plan, stage, RUN_ID, backend=GkeBackend(served.kube()))
    assert SCHEDULER in failed.value.message
    assert "cluster autoscaler: pod didn't trigger scale-up: 1 Insufficient memory" in failed.value.message
    assert [j.metadata.name for j in play.batch.list_namespaced_job("default").items] == []


def test_a_scale_up_that_fails_ends_the_wait_at_the_autoscalers_next_verdict(served, play, plan, told):
    """TriggeredScaleUp, then (the node group's creation failed, the group in backoff) NotTriggerScaleUp: the
    newest verdict counts, so the Job ends without waiting out the scale-up grace."""
    waits = dataclasses.replace(FAST, job_scale_up_grace=120)
    stage, name = stage_of(plan), exporter.job_name(stage_of(plan))
    trained(plan)

    def scale_up_fails():
        _, pod = play.job_pod(name)
        play.autoscaler_event(pod, triggered=True, detail=SCALE_UP)
        play.pod_status(pod, UNSCHEDULABLE)
        told.wait_for("cluster autoscaler: TriggeredScaleUp")
        play.autoscaler_event(pod, triggered=False, detail="1 in backoff after failed scale-up")

    with Background(scale_up_fails, told), pytest.raises(jobs.JobUnschedulable) as failed:
        verify_checkpoint.run(plan, stage, RUN_ID, backend=GkeBackend(served.kube(timings=waits)))
    assert "pod didn't trigger scale-up: 1 in backoff after failed scale-up" in failed.value.message


def test_a_node_that_does_not_come_within_the_scale_up_grace_ends_the_job_naming_the_setting(served, play, plan, told):
    waits = dataclasses.replace(FAST, job_unschedulable_grace=0, job_scale_up_grace=0.5)
    stage, name = stage_of(plan), exporter.job_name(stage_of(plan))
    trained(plan)

    def node_never_comes():
        _, pod = play.job_pod(name)
        play.autoscaler_event(pod, triggered=True, detail=SCALE_UP)
        play.pod_status(pod, UNSCHEDULABLE)

    with Background(node_never_comes), pytest.raises(jobs.JobUnschedulable) as failed:
        verify_checkpoint.run(plan, stage, RUN_ID, backend=GkeBackend(served.kube(timings=waits)))
    assert "the cluster autoscaler was adding a node for it (pod triggered scale-up: [{" in failed.value.message
    assert "timeouts.scale_up_grace" in failed.value.message and "timeouts.scale_up_grace" in failed.value.fix


def test_the_scale_up_grace_is_a_profile_timeout_and_counts_in_the_cpu_job_steps_deadlines(plan):
    """Default 15 minutes (the autoscaler's own --max-node-provision-time); ``timeouts.scale_up_grace`` changes it,
    and the steps that run a CPU Job get it in their pod deadlines."""
    gke = timings.DEFAULTS["gke"]
    assert gke.job_unschedulable_grace < gke.job_scale_up_grace == 900
    spec = plan.spec.model_copy(update={"timeouts": plan.spec.timeouts.model_copy(update={"scale_up_grace": 1800})})
    changed = timings.timings_for(spec)
    assert changed.job_scale_up_grace == 1800
    for step in ("prepare_data", "preflight", "verify_checkpoint", "export"):
        assert changed.longest_wait(step) - gke.longest_wait(step) == 900, step
    assert changed.longest_wait("launch") == gke.longest_wait("launch")


@pytest.mark.parametrize("profile", ["gke-v6e-16x2", "gke-v6e-16x2-seed"])
def test_the_shipped_profiles_put_every_cpu_job_on_a_cpu_node_pool(profile):
    """The compile Jobs and the shard workers go where the Ray head goes (the CPU pool), the export Job to its own
    pool: none is left to land on any untainted pool (the export's M3 pool among them)."""
    shipped = make_plan(config.load_profile(profile))
    stage = shipped.stages[0]
    cpu_pool = {"cloud.google.com/gke-nodepool": "cpu-pool"}
    assert shipped.spec.ray.head_node_selector == cpu_pool
    compile_job = aot.render_job(shipped, request_for(shipped, stage), None, RUN_ID)
    workers = gke_workers.render_job(shipped, stage, {"workers": 2, "fingerprint": "0123456789ab"}, RUN_ID)
    export = exporter.render_job(shipped, stage, RUN_ID)
    assert compile_job["spec"]["template"]["spec"]["nodeSelector"] == cpu_pool
    assert workers["spec"]["template"]["spec"]["nodeSelector"] == cpu_pool
    assert export["spec"]["template"]["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "export-highmem"}
