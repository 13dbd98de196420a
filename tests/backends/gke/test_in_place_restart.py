"""In-place restart on GKE, over real HTTP against the emulated cluster (tests/kube_cluster.py).

provision asks the cluster with dry runs whether it accepts ``restartStrategy: InPlaceRestart``
(multislice/backends/gke/in_place.py); admit renders what provision chose; train follows the same pods' new
containers through an in-place restart that tests/kube_controllers.py plays as JobSet v0.12.0 does it
(``Play.in_place_restart``: the kubelet's RestartAllContainers, the agents' attempt annotations, the controller's
previous/current attempts). Feature gates are off by default in the emulator, as upstream.
"""

from __future__ import annotations

import pytest

from multislice import names
from multislice.backends.base import LaunchFailed, TrainingFailed
from multislice.backends.gke import GkeBackend, in_place
from multislice.backends.gke.client import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION
from multislice.plan import make_plan
from multislice.render import in_place as render_in_place
from multislice.steps import launch, provision, train
from tests.backends.gke.harness import POOLS, Background, admitted, stage_of
from tests.kube_controllers import step_line

pytestmark = pytest.mark.usefixtures("crd_schemas", "least_privilege", "run_storage", "node_pools")


def nothing_created(play):
    """What the dry runs left: no JobSet and no Job in the namespace."""
    jobsets = play.custom.list_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, "default", JOBSET_PLURAL)
    return jobsets["items"] == [] and play.batch.list_namespaced_job("default").items == []


def test_a_cluster_without_jobsets_gate_gets_recreate_with_the_reason_and_the_fix(served, play, plan, capsys):
    report = provision.run(plan, backend=GkeBackend(served.kube()))
    assert report.restart_strategy == "Recreate"
    assert render_in_place.GATE_OFF_MESSAGE in report.restart_strategy_note
    assert "--feature-gates=InPlaceRestart=true" in report.restart_strategy_note
    out = capsys.readouterr().out
    assert "restart strategy: Recreate (restart_strategy auto): JobSet refused restartStrategy InPlaceRestart" in out
    assert nothing_created(play)
    # admit renders what provision chose (its report in the run directory)
    admitted(play, plan, served.kube())
    js = play.jobset(stage_of(plan).jobset)
    assert js["spec"]["failurePolicy"]["restartStrategy"] == "Recreate"
    assert "initContainers" not in js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def test_jobsets_gate_on_but_kubernetes_gates_off_names_the_api_server(served, play, plan, capsys):
    play.feature_gates(in_place_restart=True, restart_all_containers=False)
    report = provision.run(plan, backend=GkeBackend(served.kube()))
    assert report.restart_strategy == "Recreate"
    note = report.restart_strategy_note
    assert "the API server refused restartPolicyRules with action RestartAllContainers" in note and "HTTP 422" in note
    assert "RestartAllContainersOnContainerExits" in note and "1.35" in note
    assert nothing_created(play)


def test_in_place_asked_on_a_cluster_that_refuses_it_fails_provision(served, play, plan):
    plan = make_plan(plan.spec.model_copy(update={"restart_strategy": "in_place"}))
    with pytest.raises(in_place.InPlaceRestartUnavailable) as raised:
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert "restart_strategy in_place, but JobSet refused" in raised.value.message
    assert "--feature-gates=InPlaceRestart=true" in raised.value.fix and "restart_strategy: auto" in raised.value.fix
    assert nothing_created(play)


def test_a_host_failure_restarts_the_pods_in_place_and_train_follows_the_same_leader(served, play, plan, told):
    play.feature_gates(in_place_restart=True, restart_all_containers=True)
    kube = served.kube()
    report = provision.run(plan, backend=GkeBackend(kube))
    assert report.restart_strategy == "InPlaceRestart" and nothing_created(play)
    admit_report = admitted(play, plan, kube)
    js = stage_of(plan).jobset
    created = play.jobset(js)
    assert created["spec"]["failurePolicy"]["restartStrategy"] == "InPlaceRestart"
    pods = play.in_place_pods(js, 2, plan.slice.hosts, POOLS)
    assert play.jobset(js)["status"]["currentInPlaceRestartAttempt"] == 0  # the first barrier lifted
    leader, failed = pods[0], pods[plan.slice.hosts]  # slice 0 host 0; slice 1 host 0

    def host_fails_then_resumes():
        play.log(leader, step_line(0, 8.0) + step_line(1, 7.5))
        told.wait_for(r"completed step: 1, .*loss: 7\.500")
        assert play.in_place_restart(js, failed, 137, "OOMKilled") == 1
        told.wait_for(r"JobSet restarted in place \(1/4 restarts, attempt 1\)")
        play.log(leader, step_line(1, 7.4) + step_line(2, 7.0) + step_line(3, 6.5))  # the leader's new container
        told.wait_for(r"completed step: 3, .*loss: 6\.500")
        play.pod_status(leader, {"phase": "Succeeded"})
        play.jobset_done(js, "Completed", "AllJobsCompleted", "jobset completed successfully")

    with Background(host_fails_then_resumes, told):
        trained = train.run(plan, stage_of(plan), admit_report, backend=GkeBackend(kube))
    assert trained.leader_logs == [leader]  # the same pod throughout: its containers restarted
    assert (trained.restarts, trained.steps_trained, trained.first_loss, trained.final_loss) == (1, 4, 8.0, 6.5)
    assert trained.restart_causes == [
        f"pod {failed} (slice 1, host 0) exited with code 137 (OOMKilled); the pods restarted in place"
    ]
    # the protocol's state: every pod kept its name, is at attempt 1, its containers restarted once
    status = play.jobset(js)["status"]
    assert (status["previousInPlaceRestartAttempt"], status["currentInPlaceRestartAttempt"]) == (0, 1)
    for pod in play.core.list_namespaced_pod("default", label_selector=f"{names.JOBSET_NAME_KEY}={js}").items:
        assert pod.metadata.name in pods and pod.metadata.labels[names.RESTART_ATTEMPT_KEY] == "0"
        assert pod.metadata.annotations[render_in_place.ATTEMPT_ANNOTATION] == "1"
        assert {s.name: s.restart_count for s in pod.status.container_statuses} == {names.TRAINER_CONTAINER: 1}
        assert [s.restart_count for s in pod.status.init_container_statuses] == [1]


def test_restarts_past_max_restarts_fail_the_jobset_as_its_controller_does(served, play, plan, told):
    play.feature_gates(in_place_restart=True, restart_all_containers=True)
    plan = make_plan(plan.spec.model_copy(update={"max_restarts": 1}))
    kube = served.kube()
    provision.run(plan, backend=GkeBackend(kube))
    admit_report = admitted(play, plan, kube)
    js = stage_of(plan).jobset
    pods = play.in_place_pods(js, 2, plan.slice.hosts, POOLS)

    def two_failures():
        play.log(pods[0], step_line(0, 8.0))
        told.wait_for(r"completed step: 0,")
        play.in_place_restart(js, pods[1], 137)  # attempt 1: within maxRestarts 1
        told.wait_for(r"JobSet restarted in place \(1/1 restarts, attempt 1\)")
        play.in_place_restart(js, pods[2], 137)  # a container's restartCount 2 > 1: the controller fails it

    with Background(two_failures, told), pytest.raises(TrainingFailed) as raised:
        train.run(plan, stage_of(plan), admit_report, backend=GkeBackend(kube))
    assert "ReachedMaxRestarts" in raised.value.message


def test_a_fatal_exit_matches_no_in_place_rule_and_fails_its_pod(served, play, plan):
    play.feature_gates(in_place_restart=True, restart_all_containers=True)
    kube = served.kube()
    provision.run(plan, backend=GkeBackend(kube))
    admitted(play, plan, kube)
    js = stage_of(plan).jobset
    pods = play.in_place_pods(js, 2, plan.slice.hosts, POOLS)
    # exit 1 (a Python error): not one of the restartable codes, so the kubelet leaves the container terminated;
    # the Job's podFailurePolicy then fails the Job and the JobSet's FailJobSet rule the JobSet (the render's test)
    assert play.container_exits(pods[3], names.TRAINER_CONTAINER, 1) == "failed"
    assert play.core.read_namespaced_pod(pods[3], "default").status.phase == "Failed"
    # the controller skips Failed pods (getPodInPlaceRestartAttempts): no barrier moves, nothing restarts in place
    assert play.in_place_reconcile(js) == "nothing"
    status = play.jobset(js)["status"]
    assert status["currentInPlaceRestartAttempt"] == 0 and "previousInPlaceRestartAttempt" not in status


def test_an_agent_image_the_nodes_cannot_pull_fails_launch_naming_its_field(served, play, plan):
    play.feature_gates(in_place_restart=True, restart_all_containers=True)
    kube = served.kube()
    provision.run(plan, backend=GkeBackend(kube))
    admit_report = admitted(play, plan, kube)
    js = stage_of(plan).jobset
    [pod, *_] = play.pods(js, 2, plan.slice.hosts, pools=POOLS, phase="Pending")
    agent = {"name": render_in_place.AGENT_CONTAINER, "ready": False, "restartCount": 0, "image": "a", "imageID": "",
             "state": {"waiting": {"reason": "ErrImagePull", "message": "pull access denied"}}}  # fmt: skip
    play.pod_status(pod, {"phase": "Pending", "initContainerStatuses": [agent]})
    with pytest.raises(LaunchFailed) as raised:
        launch.run(plan, stage_of(plan), admit_report, backend=GkeBackend(kube))
    assert f"container {render_in_place.AGENT_CONTAINER}: ErrImagePull: pull access denied" in raised.value.message
    assert repr(plan.spec.images.in_place_restart_agent) in raised.value.fix and "make image-agent" in raised.value.fix
