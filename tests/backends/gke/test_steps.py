"""The GKE implementations of the steps, over real HTTP against kmock's KubernetesEmulator (tests/kube_cluster.py).

Each scenario plays Kueue, JobSet, the kubelet and GKE from a background
thread through the API, runs a step with fast timings, and asserts its
outcome and its message. The controller script never sleeps to let the step
catch up: after each change it waits until the step has told (a progress
line, :class:`Told`) or read (a watch event the emulated API sent) that it
observed it, so every intermediate state is seen however loaded the machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import time

import pytest

from multislice import config, goodput, metrics, names, reports, storage
from multislice import steps as step_lines
from multislice.backends.base import AdmissionBlocked, AdmissionTimeout, LaunchFailed, TrainingFailed
from multislice.backends.gke import GkeBackend, exporter, jobs, prerequisites, retry
from multislice.backends.gke import cluster as gke_cluster
from multislice.backends.gke import jobs as gke_jobs
from multislice.backends.gke import jobset as jobsets
from multislice.backends.gke import verifier as verifier_job
from multislice.backends.gke.aot import job_name, render_job
from multislice.delivery import lineage
from multislice.plan import make_plan
from multislice.preflight import PreflightError, PreflightFailed, request_for
from multislice.render import jobset as render_jobset
from multislice.render import manifests, rbac, schema
from multislice.steps import admit, cleanup, launch, preflight, provision, train, verify_checkpoint
from multislice.steps import export as export_step
from multislice.steps import plan as plan_step
from multislice.timings import DEFAULTS
from multislice.trainer import verify_export
from tests.backends.gke.harness import POOLS, RUN_ID, Background, stage_of
from tests.kube_cluster import FAST, wait_until
from tests.kube_controllers import Play, step_line, verification_line, verify_export_end
from tests.kube_rbac import service_account_user

# What every scenario of this module had as autouse fixtures (tests/backends/gke/conftest.py).
pytestmark = pytest.mark.usefixtures("crd_schemas", "least_privilege", "run_storage", "node_pools")


def aot_log(result: dict) -> str:
    """The AOT compile Job's log: MaxText's noise, then the result line."""
    return "Starting train_compile.py...\nAOT_RESULT " + json.dumps(result) + "\n"


#: An AOT result that fits (2 x v6e-16, the 8B stage).
FITS = {"verdict": "fits", "compile_seconds": 75.0, "cached": False, "model_tflops_per_step_per_device": 790.5,
        "memory": {"argument": 6 * 2**30, "output": 0, "alias": 0, "temp": 16 * 2**30, "generated_code": 2**26,
                   "host_argument": 0, "host_temp": 0, "total": 22 * 2**30 + 2**26}}  # fmt: skip


def job_finishes(play, name, log):
    """Play the Job controller and kubelet: wait for Job ``name``, then finish it with ``log``."""
    listed = play.batch.list_namespaced_job
    wait_until(lambda: any(j.metadata.name == name for j in listed("default").items), what=f"Job {name}")
    play.job_done(name, log)


def compile_job_finishes(play, plan, stage, result):
    """Play the compile Jobs of ``stage``: wait for each, then finish it with ``result`` in its log (an elastic
    stage has one more per smaller slice count the memory model does not rule out, :func:`preflight.check_elastic`)."""
    job_finishes(play, job_name(plan, request_for(plan, stage)), aot_log(result))
    for count in stage.elastic:
        if count.runnable and count.slices != plan.spec.num_slices:
            smaller, target = plan.on_slices(stage, count.slices)
            job_finishes(play, job_name(smaller, request_for(smaller, target)), aot_log(result))


def admitted_jobset(play, plan, kube, *, pending=None, told=None):
    """Run admit with Kueue admitting.

    With ``pending`` (a message; needs ``told``) Kueue admits only once admit has
    reported waiting with that reason for at least 1 s (rounded: 0.5 s or more).
    """
    js = stage_of(plan).jobset

    def kueue():
        play.kueue_queues(js, pending or "waiting")
        if pending:
            told.wait_for(r"waiting for admission \([1-9]\d* s\): QuotaReserved False: Pending: " + re.escape(pending))
        play.kueue_admits(js)

    with Background(kueue, told):
        return admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(kube))


def running_pods(play, plan, attempt=0):
    return play.pods(stage_of(plan).jobset, 2, plan.slice.hosts, attempt=attempt, pools=POOLS)


def training(served, play, plan):
    """A stage admitted with its pods running: ``(kube, admit report, pod names, JobSet name)``."""
    kube = served.kube()
    admitted = admitted_jobset(play, plan, kube)
    return kube, admitted, running_pods(play, plan), stage_of(plan).jobset


def finishes(play, leader, js):
    """The leader exits 0 and the JobSet completes."""
    play.pod_status(leader, {"phase": "Succeeded"})
    play.jobset_done(js, "Completed", "AllJobsCompleted", "jobset completed successfully")


def test_happy_path_every_step_with_its_reports_in_the_gs_run_directory(
    served, play, plan, node_pools, gcs, told, capsys
):
    kube = served.kube()
    stage = stage_of(plan)
    overrides = {"run_name": "r1", "output_dir": "gs://bucket/runs", "service_accounts.kueue_cluster_objects": True}
    assert plan_step.run(config.read_profile("gke-v6e-16x2-seed"), overrides, stage.name, RUN_ID) == plan

    with Background(lambda: compile_job_finishes(play, plan, stage, FITS)):
        checked = preflight.run(plan, [stage], RUN_ID, backend=GkeBackend(kube))[stage.name]
    assert checked.verdict == "fits" and checked.bytes_per_chip.total == FITS["memory"]["total"]
    preflight.result_page(plan, [checked])

    report = provision.run(plan, backend=GkeBackend(kube))
    assert node_pools == ["r1"] and [p["name"] for p in report.node_pools] == POOLS
    assert report.crds[f"jobsets.{jobsets.JOBSET_GROUP}"] == ["v1alpha2"]
    assert report.kueue_objects == [  # the CPU flavor: a run picking launcher=ray needs it for its head
        "ResourceFlavor/v6e-4x4", "ResourceFlavor/multislice-cpu", "ClusterQueue/multislice-cluster-queue",
        "WorkloadPriorityClass/default-priority", "LocalQueue/multislice-queue",
    ]  # fmt: skip
    queue = play.custom.get_cluster_custom_object(
        "kueue.x-k8s.io", "v1beta2", "clusterqueues", "multislice-cluster-queue"
    )
    assert queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] == 32
    provision.run(plan, backend=GkeBackend(kube))  # applying again is a no-op, not a conflict

    admitted = admitted_jobset(play, plan, kube)
    assert (admitted.admitted, admitted.cluster_queue, admitted.flavors) == (
        True,
        "multislice-cluster-queue",
        ["v6e-4x4"],
    )
    js = play.jobset(stage_of(plan).jobset)
    assert js["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID] == RUN_ID
    assert js["metadata"]["annotations"][jobsets.SPEC_HASH_ANNOTATION]

    pods = running_pods(play, plan)
    launched = launch.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert launched.pods == 8 and launched.node_pools == POOLS
    assert {p.node_pool for p in launched.placement.values() if p.slice == 1} == {"tpu-pool-1"}

    def leader_trains():
        for step in range(4):
            play.log(pods[0], step_line(step, 8.0 - step))
            told.wait_for(f"completed step: {step},")  # train read it while following the log
        finishes(play, pods[0], stage_of(plan).jobset)

    with Background(leader_trains, told):
        trained = train.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert (trained.steps_trained, trained.first_loss, trained.final_loss) == (4, 8.0, 5.0)
    assert trained.tokens_per_second_per_device == pytest.approx(2000.0)
    assert trained.restarts == 0 and trained.leader_logs == [pods[0]]
    # Goodput for every stage, not only elastic ones: the four steps' time over the job's, badput by cause.
    assert set(trained.badput_seconds) == set(goodput.CATEGORIES) and trained.steps_lost == 0
    assert 0 < (trained.goodput or 0) <= 1 and trained.job_seconds == pytest.approx(trained.wall_seconds, abs=0.1)

    # The stage exports: its verify-and-export Job (the export's report in the log too; the export step is below).
    exported = {"verdict": "PASS", "format": "huggingface", "export_dir": stage.export_dir}
    log = verification_line() + verify_export_end(export=exported)
    with Background(lambda: job_finishes(play, f"{stage.jobset}-verify", log)):
        verified = verify_checkpoint.run(plan, stage_of(plan), backend=GkeBackend(kube))
    assert verified.verdict == "PASS" and verified.job == f"{stage_of(plan).jobset}-verify"
    job = play.batch.read_namespaced_job(f"{stage_of(plan).jobset}-verify", "default")
    assert job.metadata.labels[names.LABEL_PIPELINE_RUN_ID] == RUN_ID
    assert job.spec.template.spec.service_account_name == plan.spec.service_accounts.trainer

    pages = train.result_pages(plan, stage, trained)
    done = cleanup.run("gke", "gs://bucket/runs", "r1", RUN_ID, "SUCCEEDED", backend=GkeBackend(kube))
    assert done.deleted == [] and done.kept == [stage_of(plan).jobset]
    out = capsys.readouterr().out
    assert "CRDs served: jobsets.jobset.x-k8s.io v1alpha2" in out
    assert "completed step: 3" in out

    # Every step's report, the UI pages and the metrics records are in the gs:// run directory.
    reports_dir = f"runs/r1/reports/{stage.name}/"
    written = gcs.names(prefix="runs/r1/")
    for name in ("plan.json", "preflight.json", "preflight.html", "admit.json", "launch.json", "train.json",
                 "train.html", "train.md", "verification.json", "verification.md"):  # fmt: skip
        assert reports_dir + name in written, name
    assert {"runs/r1/reports/provision.json", "runs/r1/reports/cleanup.json"} <= set(written)
    assert f"runs/r1/manifests/{stage.jobset}.tpu.yaml" in written and "runs/r1/manifests/kueue.yaml" in written
    assert reports.read(reports.TrainReport, plan, stage) == trained
    assert metrics.read_records(stage.metrics_file)[-1]["learning/loss"] == 5.0
    page = storage.read_text(f"gs://bucket/{reports_dir}train.html")
    assert page == pages["html"] and re.search(r'<img [^>]*src="data:image/png;base64,', page)


def test_waiting_on_quota_then_admitted_reports_the_pending_reason(served, play, plan, told, capsys):
    message = "couldn't assign flavors to pod set slice: insufficient quota for google.com/tpu in flavor v6e-16"
    report = admitted_jobset(play, plan, served.kube(), pending=message, told=told)
    assert report.admitted and report.wait_seconds >= 0.4
    assert f"QuotaReserved False: Pending: {message}" in capsys.readouterr().out


def test_admission_timeout_names_the_reason_and_deletes_the_jobset(served, play, plan, monkeypatch):
    js = stage_of(plan).jobset
    backend = GkeBackend(served.kube(timings=dataclasses.replace(FAST, admit_timeout=4)))
    submit = backend.submit

    def submit_then_queued(manifest):
        """Kueue queues the JobSet as it is created: the wait for admission starts with the reason known."""
        submitted = submit(manifest)
        play.kueue_queues(js, "insufficient quota for google.com/tpu")
        return submitted

    monkeypatch.setattr(backend, "submit", submit_then_queued)
    with pytest.raises(AdmissionTimeout, match="last reason: QuotaReserved False: Pending: insufficient quota"):
        admit.run(plan, stage_of(plan), RUN_ID, backend=backend)
    assert served.kube().get_jobset(js) is None


def test_retried_admit_adopts_its_jobset_and_a_different_spec_is_an_error(served, play, plan):
    kube = served.kube()
    admitted_jobset(play, plan, kube)
    again = admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(kube))
    assert again.adopted is True and again.admitted is True
    other = make_plan(plan.spec.model_copy(update={"max_restarts": 9}))
    with pytest.raises(
        jobsets.JobSetConflict,
        match=r"already exists with a different spec \(pipeline run run-1111.*kubectl delete jobset",
    ):
        admit.run(other, stage_of(plan), RUN_ID, backend=GkeBackend(kube))
    assert kube.get_jobset(stage_of(plan).jobset)["spec"]["failurePolicy"]["maxRestarts"] == 4  # untouched


def test_a_run_continuing_an_earlier_one_replaces_its_finished_jobset_and_a_running_one_is_a_conflict(
    served, play, plan
):
    kube, js = served.kube(), stage_of(plan).jobset
    admitted_jobset(play, plan, kube)  # pipeline run RUN_ID
    play.jobset_done(js, "Completed", "AllJobsCompleted", "jobset completed successfully")  # cleanup keeps it

    def kueue():  # once the new JobSet exists (the old one deleted first)
        wait_until(lambda: (kube.get_jobset(js) or {"metadata": {}})["metadata"].get("labels", {}).get(
            names.LABEL_PIPELINE_RUN_ID) == "run-2222", what="the replacing JobSet")  # fmt: skip
        play.custom.delete_namespaced_custom_object(  # the garbage collector: the old JobSet's Workload goes with it
            "kueue.x-k8s.io", "v1beta2", play.ns, "workloads", play.workload_name(js)
        )
        play.kueue_queues(js, "waiting")
        play.kueue_admits(js)

    with Background(kueue):
        again = admit.run(plan, stage_of(plan), "run-2222", backend=GkeBackend(kube))
    assert again.replaced == RUN_ID and again.adopted is False and again.admitted is True
    stored = kube.get_jobset(js)
    assert stored["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID] == "run-2222"
    assert jobsets.phase(stored) != "Completed"
    with pytest.raises(jobsets.JobSetConflict, match=r"pipeline run run-2222"):  # unfinished: never deleted
        admit.run(plan, stage_of(plan), "run-3333", backend=GkeBackend(kube))
    assert kube.get_jobset(js)["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID] == "run-2222"


def test_evicted_then_readmitted_during_training(served, play, plan, told, capsys):
    kube, admitted, pods, js = training(served, play, plan)

    def preempted_then_resumed():
        play.log(pods[0], step_line(0, 8.0))
        told.wait_for("completed step: 0,")
        play.kueue_evicts(js, "Preempted to accommodate a workload (UID: 42) due to prioritization in the ClusterQueue")
        told.wait_for(r"JobSet suspended by Kueue \(Evicted True: Preempted: ")
        play.kueue_admits(js)
        told.wait_for("JobSet admitted again after")
        play.log(pods[0], step_line(1, 7.0))
        told.wait_for("completed step: 1,")
        finishes(play, pods[0], js)

    with Background(preempted_then_resumed, told):
        trained = train.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert trained.steps_trained == 2
    out = capsys.readouterr().out
    assert "JobSet suspended by Kueue (Evicted True: Preempted: Preempted to accommodate a workload" in out
    assert "JobSet admitted again after" in out


def test_unschedulable_past_the_deadline_fails_launch_quoting_events(served, play, plan):
    kube = served.kube()
    admitted = admitted_jobset(play, plan, kube)
    message = "0/8 nodes are available: 8 node(s) didn't match Pod's node affinity/selector."
    status = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                                  "message": message}]}  # fmt: skip
    pods = play.pods(stage_of(plan).jobset, 2, plan.slice.hosts, status=status)
    play.event(pods[0], "FailedScheduling", message)
    started = time.monotonic()
    with pytest.raises(LaunchFailed) as failure:
        launch.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert time.monotonic() - started >= kube.timings.unschedulable_grace
    text = str(failure.value)
    assert f"pod {pods[0]} (slice 0, host 0) Unschedulable for" in text
    assert f"Warning FailedScheduling: {message}" in text and "TPU node pools of v6e-16" in failure.value.fix


def test_image_pull_failure_fails_launch_at_once(served, play, plan):
    kube = served.kube()
    admitted = admitted_jobset(play, plan, kube)
    back_off = {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "x"'}
    waiting = {"name": names.TRAINER_CONTAINER, "ready": False, "restartCount": 0, "image": "x", "imageID": "",
               "state": {"waiting": back_off}}  # fmt: skip
    pods = play.pods(
        stage_of(plan).jobset, 2, plan.slice.hosts, status={"phase": "Pending", "containerStatuses": [waiting]}
    )
    play.event(pods[0], "Failed", 'Failed to pull image "x": not found')
    started = time.monotonic()
    with pytest.raises(LaunchFailed, match=r"cannot start: container maxtext: ImagePullBackOff") as failure:
        launch.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert time.monotonic() - started < kube.timings.launch_timeout
    assert 'Warning Failed: Failed to pull image "x": not found' in str(failure.value)


def test_jobset_failed_after_max_restarts_reports_exit_codes_and_log_tails(served, play, plan, told, capsys):
    kube = served.kube()
    admitted = admitted_jobset(play, plan, kube)
    js = stage_of(plan).jobset
    first = running_pods(play, plan, attempt=0)

    def keeps_failing():
        play.log(first[0], step_line(0, 8.0))
        told.wait_for("completed step: 0,")
        terminated = {"name": names.TRAINER_CONTAINER, "ready": False, "restartCount": 0, "image": "t", "imageID": "",
                      "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}  # fmt: skip
        play.pod_status(first[0], {"phase": "Failed", "containerStatuses": [terminated]})
        play.patch_jobset(js, {"status": {"restarts": 1}}, status=True)
        told.wait_for(r"JobSet restarted \(1/4 restarts\)")  # before the JobSet's last state (4 restarts)
        second = running_pods(play, plan, attempt=1)
        play.log(second[0], step_line(0, 8.0) + "RESOURCE_EXHAUSTED: out of HBM\n")
        told.wait_for("completed step: 0,")
        play.pod_status(second[0], {"phase": "Failed", "containerStatuses": [terminated]})
        play.jobset_done(js, "Failed", "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts", 4)

    with Background(keeps_failing, told), pytest.raises(TrainingFailed) as failure:
        train.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    text = str(failure.value)
    assert (
        f"JobSet {js} Failed (ReachedMaxRestarts: jobset failed due to reaching max number of restarts), restarts 4"
        in text
    )
    assert f"pod {first[0]} (slice 0, host 0, attempt 0) exit code 137" in text
    assert "RESOURCE_EXHAUSTED: out of HBM" in text
    out = capsys.readouterr().out
    assert "JobSet restarted (1/4 restarts); following the new leader" in out
    # the restart's cause: the failed pod of attempt 0, its exit code and the kubelet's reason
    assert f"restart 1 cause: pod {first[0]} (slice 0, host 0) exited with code 137 (OOMKilled)" in out


def test_watch_410_during_training_relists_and_finishes(served, play, plan, told, capsys):
    kube, admitted, pods, js = training(served, play, plan)

    def compacts():
        play.log(pods[0], step_line(0, 8.0))
        told.wait_for("completed step: 0,")
        touched = play.patch_jobset(js, {"metadata": {"annotations": {"touched": "1"}}})
        version = int(touched["metadata"]["resourceVersion"])
        wait_until(  # the step's watch has seen the patch (sent it, or listed after it), so it resumes from >= it
            lambda: served.cluster.watched("jobsets") >= version,
            what=f"the JobSet watch to see resourceVersion {version}",
        )
        served.cluster.compact()
        told.wait_for(rf"watch of JobSet {js} expired \(410 Gone")
        play.log(pods[0], step_line(1, 7.5))
        told.wait_for("completed step: 1,")
        finishes(play, pods[0], js)

    with Background(compacts, told):
        trained = train.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert trained.steps_trained == 2
    assert f"watch of JobSet {js} expired (410 Gone" in capsys.readouterr().out


def test_api_500s_are_retried_then_recover_and_a_deadline_ends_them(served, play, plan, capsys):
    kube = served.kube(say=print)
    served.cluster.fail_next(3, 500)
    report = provision.run(plan, backend=GkeBackend(kube))
    assert report.kueue_objects
    assert capsys.readouterr().out.count("HTTP 500") == 3
    served.cluster.fail_next(1000, 503)
    with pytest.raises(
        retry.ApiUnavailable, match=r"failed \d+ times within its 3 s retry deadline, last with HTTP 503"
    ):
        gke_cluster.check_crds(served.kube(timings=dataclasses.replace(FAST, api_deadline=3), say=print))
    served.cluster.faults.clear()


def test_missing_crds_name_the_versions_found_and_what_to_install(served, plan, node_pools):
    player = Play(served)
    player.install_crds(skip=("workloads.kueue.x-k8s.io",))
    with pytest.raises(
        gke_cluster.CrdsMissing, match=r"workloads.kueue.x-k8s.io needs v1beta2, the cluster serves nothing"
    ):
        provision.run(plan, backend=GkeBackend(served.kube()))
    # An older Kueue: ClusterQueues served at v1beta1 only.
    old = {"spec": {"versions": [{"name": "v1beta1", "served": True, "storage": True}]}}
    player.crds.patch_custom_resource_definition("clusterqueues.kueue.x-k8s.io", old)
    with pytest.raises(gke_cluster.CrdsMissing) as failure:
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert "clusterqueues.kueue.x-k8s.io needs v1beta2, the cluster serves v1beta1" in str(failure.value)
    assert "install Kueue v0.19 or later" in str(failure.value) and "jobsets" not in str(failure.value)
    assert node_pools == []  # checked before any node pool is asked for


def test_cancel_mid_train_deletes_the_jobset_and_cleanup_spares_other_runs(served, play, plan, told):
    kube = served.kube()
    admitted = admitted_jobset(play, plan, kube)
    js = stage_of(plan).jobset
    pods = running_pods(play, plan)
    labels = {names.LABEL_PIPELINE_RUN_ID: "run-2222"}
    other = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
             "metadata": {"name": "someone-else", "labels": labels}, "spec": {}}  # fmt: skip
    play.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets", other)

    def cancelled_while_following():  # the pipeline run is cancelled once train follows the leader's log
        play.log(pods[0], step_line(0, 8.0))
        told.wait_for("completed step: 0,")
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingFailed, match=f"cancelled; {stage_of(plan).jobset} deleted"):
        with Background(cancelled_while_following, told):
            train.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert kube.get_jobset(js) is None

    # The exit handler: this run's unfinished JobSet goes, the other run's stays.
    play.custom.delete_namespaced_custom_object(  # what garbage collection does after the JobSet's deletion
        "kueue.x-k8s.io", "v1beta2", "default", "workloads", play.workload_name(js)
    )
    second = admitted_jobset(play, make_plan(plan.spec), kube)  # re-create stage 1's JobSet as a queued one
    assert second.admitted
    done = cleanup.run("gke", "gs://bucket/runs", "r1", RUN_ID, "CANCELLED", backend=GkeBackend(kube))
    assert done.deleted == [f"JobSet {js} (Running)"]
    assert kube.get_jobset(js) is None and kube.get_jobset("someone-else") is not None


def test_no_exit_path_of_another_run_of_the_same_name_deletes_the_owners_jobset(served, play, plan, told):
    """Run A (RUN_ID) trains stage 1; run B of the same run_name is refused at admit (the JobSet name is A's),
    then B is cancelled and its exit handler runs: A's JobSet stays. And a JobSet of A's that was deleted and
    recreated by run C between A's list and A's delete (a stale list) is left: the delete's uid precondition."""
    kube, js = served.kube(), stage_of(plan).jobset
    admitted_jobset(play, plan, kube)
    uid = kube.get_jobset(js)["metadata"]["uid"]
    backend = GkeBackend(kube)
    with pytest.raises(jobsets.JobSetConflict, match=f"pipeline run {RUN_ID}"):
        admit.run(plan, stage_of(plan), "run-bbbb", backend=backend)
    labels = step_lines.stage_labels(plan, stage_of(plan), "run-bbbb")
    assert backend.delete_matching(labels, print) == []  # B's steps, cancelled
    assert backend.delete(js, owner="run-bbbb") is False
    assert cleanup.run("gke", "gs://bucket/runs", "r1", "run-bbbb", "CANCELLED", backend=backend).deleted == []
    with pytest.raises(ValueError, match="pipeline run id"):
        backend.delete_matching({names.LABEL_RUN_NAME: "r1"}, print)  # no run id: refused, never "everything"
    assert kube.get_jobset(js)["metadata"]["uid"] == uid

    stale = kube.list_jobsets(jobsets.run_selector(RUN_ID))  # A's cleanup lists its JobSet ...
    play.custom.delete_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets", js)
    recreated = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                 "metadata": {"name": js, "labels": {names.LABEL_PIPELINE_RUN_ID: "run-cccc"}}, "spec": {}}  # fmt: skip
    play.custom.create_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets", recreated)
    kube.list_jobsets = lambda selector: stale  # ... and deletes from that listing after C recreated the name
    assert backend.cleanup(RUN_ID, print) == ([], [])
    assert kube.get_jobset(js)["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID] == "run-cccc"

    # A trainer-image Job (verifier, AOT compile) of A's, under a name B's would also take: B's cancelled step
    # leaves it; A's own deletes it.
    job = verifier_job.render_job(plan, stage_of(plan), RUN_ID)
    play.batch.create_namespaced_job("default", job)
    name = job["metadata"]["name"]
    assert gke_jobs._delete(kube, name, "run-bbbb") is False
    assert kube.batch.read_namespaced_job(name, "default").metadata.labels[names.LABEL_PIPELINE_RUN_ID] == RUN_ID
    assert gke_jobs._delete(kube, name, RUN_ID) is True


def test_multislice_cleanup_keeps_a_workload_whose_lease_is_renewed_and_removes_it_once_expired(served, play, plan):
    """``multislice cleanup --run r1`` on GKE (:meth:`GkeBackend.delete_abandoned`): a JobSet whose Lease a step of
    its pipeline run renews is that run's, alive, and kept; once the Lease expired (no step left), it goes."""
    kube, js = served.kube(), stage_of(plan).jobset
    admitted_jobset(play, plan, kube)  # admit renewed the JobSet's Lease while it waited
    backend = GkeBackend(kube)
    kept = [f"JobSet {js}: its pipeline run {RUN_ID} still renews its Lease"]
    assert backend.delete_abandoned("r1", print) == ([], kept)
    assert kube.get_jobset(js) is not None
    play.custom.patch_namespaced_custom_object(  # the last renewal long ago: the run's steps are gone
        "coordination.k8s.io", "v1", "default", "leases", js, {"spec": {"renewTime": "2020-01-01T00:00:00.000000Z"}}
    )
    deleted, kept = backend.delete_abandoned("r1", print)
    assert [line.split(" (")[0] for line in deleted] == [f"JobSet {js}"] and kept == []
    assert kube.get_jobset(js) is None


def test_train_reattaches_to_the_new_leader_after_a_jobset_restart(served, play, plan, told):
    kube, admitted, first, js = training(served, play, plan)

    def host_lost_then_resumed():
        play.log(first[0], step_line(0, 8.0) + step_line(1, 7.5))
        told.wait_for(r"completed step: 1, .*loss: 7\.500")  # the first leader's log is read
        play.pod_status(first[0], {"phase": "Failed"})
        play.patch_jobset(js, {"status": {"restarts": 1}}, status=True)
        told.wait_for(r"JobSet restarted \(1/4 restarts\)")
        second = running_pods(play, plan, attempt=1)
        play.log(second[0], step_line(1, 7.4) + step_line(2, 7.0) + step_line(3, 6.5))
        told.wait_for(r"completed step: 3, .*loss: 6\.500")  # the new leader's log is read
        finishes(play, second[0], js)

    with Background(host_lost_then_resumed, told):
        trained = train.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert trained.leader_logs == [first[0], play.pod_name(js, 0, 0, attempt=1)]
    assert (trained.restarts, trained.steps_trained, trained.records) == (1, 4, 5)
    assert (trained.first_loss, trained.final_loss) == (8.0, 6.5)
    assert trained.restart_causes == [f"pod {first[0]} (slice 0, host 0) Failed"]  # no container status: the phase


def test_cluster_scoped_kueue_objects_are_left_to_an_admin_by_default(served, bare_play, plan, capsys):
    play = bare_play  # no Kueue objects applied yet
    plan = make_plan(plan.spec.model_copy(update={"service_accounts": config.ServiceAccountsSpec()}))
    report = provision.run(plan, backend=GkeBackend(served.kube()))
    assert report.kueue_objects == ["LocalQueue/multislice-queue"]
    assert report.kueue_objects_left_to_admin == [
        "ResourceFlavor/v6e-4x4", "ResourceFlavor/multislice-cpu", "ClusterQueue/multislice-cluster-queue",
        "WorkloadPriorityClass/default-priority",
    ]  # fmt: skip
    assert "service_accounts.kueue_cluster_objects is false" in capsys.readouterr().out
    found = play.custom.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "clusterqueues")
    assert found["items"] == []


def test_preflight_on_gke_compiles_each_stage_in_a_trainer_job_and_fails_before_provision(served, play, plan, capsys):
    kube = served.kube()
    plan = plan.model_copy(update={"spec": plan.spec.model_copy(update={"preflight": plan.spec.preflight.model_copy(
        update={"suggest_alternative": False})})})  # fmt: skip
    eight, seventy = plan.stages
    oom = {"verdict": "does_not_fit", "compile_seconds": 14.0, "cached": True,
           "oom": {"required_bytes": round(49.82 * 2**30), "available_bytes": round(31.24 * 2**30)}}  # fmt: skip

    def compiler():
        for stage, result in ((eight, FITS), (seventy, oom)):
            compile_job_finishes(play, plan, stage, result)

    with Background(compiler), pytest.raises(PreflightFailed) as failed:
        preflight.run(plan, pipeline_run_id=RUN_ID, backend=GkeBackend(kube))
    assert "stage llama3-70b: does not fit on 2 x v6e-16: needs 49.82 GiB per chip" in str(failed.value)
    assert "nothing was provisioned" in str(failed.value)
    job = play.batch.read_namespaced_job(job_name(plan, request_for(plan, eight)), "default")
    container = job.spec.template.spec.containers[0]
    assert container.image == plan.spec.images.trainer
    assert container.command[:3] == ["python", "-m", "multislice.trainer.aot"]
    assert json.loads(container.command[container.command.index("--request-json") + 1]) == request_for(plan, eight)
    assert container.command[-2:] == ["--cache-dir", "gs://bucket/runs/preflight-cache"]
    assert "google.com/tpu" not in (container.resources.limits or {})  # a CPU node compiles for the TPU topology
    assert job.spec.template.spec.service_account_name == plan.spec.service_accounts.trainer
    assert job.metadata.labels[names.LABEL_PIPELINE_RUN_ID] == RUN_ID
    out = capsys.readouterr().out
    assert "[preflight llama3-8b] fits on 2 x v6e-16: 22.06 GiB of 31.24 GiB HBM per chip" in out


def test_provision_on_an_empty_cluster_creates_the_local_queue_under_enforced_rbac(served, play, plan, least_privilege):
    # Nothing of the run's exists yet: the apply creates the LocalQueue, authorized as patch and as create (patch.go).
    plan = make_plan(plan.spec.model_copy(update={"service_accounts": config.ServiceAccountsSpec()}))
    served.as_user(served.user, rbac.render_rbac_objects(plan))
    report = provision.run(plan, backend=GkeBackend(served.kube()))
    assert report.kueue_objects == ["LocalQueue/multislice-queue"]
    queue = play.custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", "default", "localqueues",
                                                     "multislice-queue")  # fmt: skip
    assert queue["spec"]["clusterQueue"] == "multislice-cluster-queue"
    assert served.cluster.authorizer.denied == []


def test_a_verb_rbac_does_not_grant_is_forbidden_as_the_api_server_says(served, bare_play, plan):
    objects = rbac.render_rbac_objects(plan)
    for obj in objects:
        for rule in obj.get("rules", []):
            if rule["resources"] == ["localqueues"]:
                rule["verbs"] = ["get", "patch"]  # what the Role granted before: apply cannot create
    served.as_user(served.user, objects)
    # provision's SelfSubjectAccessReviews see it first: refused before any node pool, nothing tried.
    with pytest.raises(prerequisites.AccessMissing, match=r'Missing: create localqueues\.kueue\.x-k8s\.io '
                       r'"multislice-queue" in namespace "default"'):  # fmt: skip
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert served.cluster.authorizer.denied == []
    # The apply itself, tried anyway, is refused as the API server refuses it (patch.go: an apply that creates is
    # authorized as create too).
    local_queue = next(o for o in provision.kueue_objects(plan) if o["kind"] == "LocalQueue")
    with pytest.raises(Exception, match="403") as refused:
        gke_cluster.server_side_apply(served.kube(), local_queue)
    assert served.cluster.authorizer.denied == [
        'localqueues.kueue.x-k8s.io "multislice-queue" is forbidden: User '
        '"system:serviceaccount:default:multislice-pipeline" cannot create resource "localqueues" in API group '
        '"kueue.x-k8s.io" in the namespace "default"'
    ]
    assert "forbidden" in str(refused.value)


BLOCKED = [
    pytest.param(
        "event", 'WorkloadPriorityClass "default-priority" not found',
        r"event WorkloadPriorityClassNotFound: WorkloadPriorityClass \"default-priority\" not found",
        "set `priority` to an existing WorkloadPriorityClass", id="missing-priority-class",
    ),
    pytest.param(
        "Inadmissible", "LocalQueue multislice-queue doesn't exist",
        "QuotaReserved False: Inadmissible: LocalQueue multislice-queue doesn't exist",
        "run the provision step, which applies LocalQueue multislice-queue", id="missing-local-queue",
    ),
    pytest.param(
        "Pending", "couldn't assign flavors to pod set slice: resource google.com/tpu unavailable in ClusterQueue",
        "resource google.com/tpu unavailable in ClusterQueue",
        "a pod set requests google.com/tpu and no resource group of the ClusterQueue covers it",
        id="inadmissible-flavor",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("reason", "message", "cause", "fix"), BLOCKED)
def test_admit_fails_fast_with_the_cause_when_kueue_cannot_admit(served, play, plan, reason, message, cause, fix):
    js = stage_of(plan).jobset

    def kueue():
        play.jobset(js)
        if reason == "event":  # Kueue creates no Workload and says why on the JobSet (kueue #3439, #13775)
            play.event(js, "WorkloadPriorityClassNotFound", message, involved="JobSet")
        else:
            play.kueue_queues(js, message, reason=reason)

    with Background(kueue), pytest.raises(AdmissionBlocked) as refused:
        admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(served.kube()))
    assert re.search(cause, refused.value.message), refused.value.message
    assert fix in refused.value.fix
    assert "was deleted" in refused.value.message  # admit created it, so admit deletes it
    assert play.custom.list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", "default", "jobsets")["items"] == []


def test_an_unschedulable_compile_job_fails_preflight_with_the_schedulers_message(served, play, plan, told):
    plan = plan.model_copy(update={"spec": plan.spec.model_copy(update={"preflight": plan.spec.preflight.model_copy(
        update={"suggest_alternative": False,
                "node_selector": {"cloud.google.com/gke-nodepool": "cpu-pool"}})})})  # fmt: skip
    stage = stage_of(plan)
    name = job_name(plan, request_for(plan, stage))
    scheduler = "0/8 nodes are available: 8 node(s) didn't match Pod's node affinity/selector."

    def scheduler_cannot_place():
        listed = play.batch.list_namespaced_job
        wait_until(lambda: any(j.metadata.name == name for j in listed("default").items), what=f"Job {name}")
        unplaced = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": scheduler}]}  # fmt: skip
        play.core.create_namespaced_pod(
            "default", {"metadata": {"name": f"{name}-xyz12", "labels": {"job-name": name}}, "status": unplaced}
        )
        told.wait_for(re.escape(f"pod Unschedulable: {scheduler}"))

    with Background(scheduler_cannot_place, told), pytest.raises(PreflightError) as failed:
        preflight.run(plan, [stage], RUN_ID, backend=GkeBackend(served.kube()))
    assert f"AOT compile Job {name}: its pod stayed Unschedulable" in failed.value.message
    assert scheduler in failed.value.message and "(the Job was deleted)" in failed.value.message
    assert "preflight.node_selector" in failed.value.fix and "cpu 2, memory 8Gi" in failed.value.fix
    assert [j.metadata.name for j in play.batch.list_namespaced_job("default").items] == []
    # The verdict is reported within a minute of the pod being unschedulable, not after timeouts.compile.
    assert DEFAULTS["gke"].job_unschedulable_grace <= 60 < DEFAULTS["gke"].compile_timeout


def test_compile_jobs_go_to_the_profiles_node_selector(plan):
    plan = plan.model_copy(update={"spec": plan.spec.model_copy(update={"preflight": plan.spec.preflight.model_copy(
        update={"node_selector": {"cloud.google.com/gke-nodepool": "cpu-pool"}})})})  # fmt: skip
    job = render_job(plan, request_for(plan, stage_of(plan)), None, RUN_ID)
    assert job["spec"]["template"]["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "cpu-pool"}


def test_log_rotation_during_training_loses_no_step_line(served, play, plan, told):
    kube, admitted, pods, js = training(served, play, plan)

    def leader_trains_and_the_kubelet_rotates():
        play.log(pods[0], step_line(0, 8.0) + step_line(1, 7.5))
        told.wait_for(r"completed step: 1, .*loss: 7\.500")
        served.cluster.rotate_log("default", pods[0])  # the lines so far leave the log; the follow ends
        play.log(pods[0], step_line(2, 7.0) + step_line(3, 6.5))
        told.wait_for(r"completed step: 3, .*loss: 6\.500")  # read after the re-attach
        finishes(play, pods[0], js)

    with Background(leader_trains_and_the_kubelet_rotates, told):
        trained = train.run(plan, stage_of(plan), admitted, backend=GkeBackend(kube))
    assert (trained.steps_trained, trained.first_loss, trained.final_loss) == (4, 8.0, 6.5)
    assert trained.records == 4  # each step once: nothing lost, nothing repeated


# ---------------------------------------------------------------- the cluster's safety net (problem 5)

KILLED_IN = ["admission wait", "launch", "train"]


@pytest.mark.parametrize("phase", KILLED_IN)
def test_a_run_killed_without_its_handlers_leaves_no_jobset_after_the_lease_bound(served, play, plan, phase):
    """Terminate on KFP may run no exit handler (kubeflow/pipelines#10917) and SIGKILL runs no step handler: the step's
    Lease renewals stop, and the reaper deletes the JobSet once the Lease expired, within ``lease.orphan_bound()``."""
    import datetime

    from multislice.backends.base import WorkloadDeleted
    from multislice.backends.gke import lease

    kube, stage = served.kube(), stage_of(plan)
    js, backend = stage.jobset, GkeBackend(kube, lease_seconds=3)
    step = {"admission wait": "admit", "launch": "launch", "train": "train"}[phase]
    seen = {}

    def killed_then_reaped():
        if phase == "admission wait":
            wait_until(lambda: kube.get_jobset(js), what="admit creating the JobSet")
            play.kueue_queues(js, "insufficient quota for google.com/tpu")  # admit waits for admission
        held = wait_until(
            lambda: [h for h in backend.holders if h.holder.startswith(step) and h.renewals], what=f"{step} holding"
        )[-1]
        held.stop()  # SIGKILL: the step's process is gone; nothing renews its Lease and no handler runs
        held.thread.join()
        last = lease.get(kube, js)
        expires = lease.expires(kube.get_jobset(js), last)
        seen["early"] = lease.reap(kube, now=expires - datetime.timedelta(seconds=1), tell=print)
        seen["kept"] = kube.get_jobset(js) is not None
        renewed = datetime.datetime.fromisoformat(last["spec"]["renewTime"].replace("Z", "+00:00"))
        seen["reaped"] = lease.reap(kube, now=renewed + datetime.timedelta(seconds=lease.orphan_bound(3)), tell=print)

    if phase == "admission wait":
        running = lambda: admit.run(plan, stage, RUN_ID, backend=backend)  # noqa: E731
    else:
        admitted = admitted_jobset(play, plan, kube)
        if phase == "train":
            running_pods(play, plan)
        run = {"launch": launch.run, "train": train.run}[phase]
        running = lambda: run(plan, stage, admitted, backend=backend)  # noqa: E731
    with pytest.raises(WorkloadDeleted, match="deleted"), Background(killed_then_reaped):
        running()  # here the orphaned wait itself ends too; a killed step's pod is gone already
    assert seen == {"early": [], "kept": True, "reaped": [js]}  # held until it expired, then reaped
    assert kube.get_jobset(js) is None and lease.get(kube, js) is None  # nothing of the run is left


def test_the_reaper_spares_held_finished_and_foreign_jobsets(served, play, plan):
    import datetime

    from multislice.backends.gke import lease

    kube, js = served.kube(), stage_of(plan).jobset
    admitted_jobset(play, plan, kube)
    lease.renew(kube, js, "train/pod-1", seconds=600)
    assert lease.reap(kube, tell=print) == []  # held
    late = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    play.jobset_done(js, "Completed", "AllJobsCompleted", "jobset completed successfully")
    assert lease.reap(kube, now=late, tell=print) == []  # finished: holds no TPUs, kept as cleanup keeps it
    cron = lease.reaper_cronjob("default", "multislice-pipeline:0.1.0", "pipeline-runner", plan.spec.cluster)
    container = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid" and container["command"][:2] == ["multislice", "reap"]


def test_the_reaper_leaves_a_hand_applied_render_and_reaps_a_leaseless_jobset_of_a_held_run(served, plan):
    """A JobSet applied by hand from ``multislice render`` output (run id label ``manual``, no Lease) is never reaped;
    one created by a pipeline run's step that died before its first Lease renewal is, once its run holds a run
    Lease (every step of a pipeline run creates or renews it first) and a lease duration has passed."""
    import datetime

    from multislice.backends import manifests as all_manifests
    from multislice.backends.gke import jobset as gke_jobset
    from multislice.backends.gke import lease

    kube, stage = served.kube(), stage_of(plan)
    hand = all_manifests.render_all(plan, "manual")[f"jobset-{stage.name}.tpu.yaml"]  # render's default run id
    gke_jobset.create_or_adopt(kube, hand)
    late = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    assert lease.reap(kube, now=late, tell=print) == []
    assert kube.get_jobset(stage.jobset) is not None  # not a pipeline run's: left to whoever applied it
    gke_jobset.delete(kube, stage.jobset, kube.get_jobset(stage.jobset)["metadata"]["uid"])
    wait_until(lambda: kube.get_jobset(stage.jobset) is None, what="the hand-applied JobSet gone")
    lease.hold_run(kube, RUN_ID, plan.spec.run_name, plan.run_dir, "launch/pod-1")
    gke_jobset.create_or_adopt(kube, render_jobset.render_jobset(plan, stage, hardware="tpu", pipeline_run_id=RUN_ID))
    assert lease.get(kube, stage.jobset) is None  # the step died before its JobSet's first Lease
    assert lease.reap(kube, now=late, tell=print) == [stage.jobset]


def test_a_single_slice_run_renders_provisions_admits_launches_and_trains(served, play, node_pools, told, capsys):
    """``num_slices: 1`` (GKE's single-slice TPU shape: one Indexed child Job of 4 hosts, no DCN) through every step."""
    overrides = {"run_name": "r1", "output_dir": "gs://bucket/runs", "service_accounts.kueue_cluster_objects": True,
                 "num_slices": 1, "stages.llama3-70b.dcn.fsdp": 1}  # fmt: skip
    plan = plan_step.run(config.read_profile("gke-v6e-16x2-seed"), overrides, "llama3-8b", RUN_ID)
    served.as_user(service_account_user(plan.spec.namespace, plan.spec.service_accounts.pipeline),
                   rbac.render_rbac_objects(plan))  # fmt: skip
    stage, kube = stage_of(plan), served.kube()
    assert plan.total_chips == 16 and set(stage.dcn.values()) == {1}
    rendered = render_jobset.render_jobset(plan, stage, hardware=GkeBackend.hardware, pipeline_run_id=RUN_ID)
    schema.validate(rendered)
    [slices] = rendered["spec"]["replicatedJobs"]
    assert slices["replicas"] == 1 and slices["template"]["spec"]["completionMode"] == "Indexed"
    assert slices["template"]["spec"]["parallelism"] == slices["template"]["spec"]["completions"] == 4

    with Background(lambda: compile_job_finishes(play, plan, stage, FITS)):
        checked = preflight.run(plan, [stage], RUN_ID, backend=GkeBackend(kube))[stage.name]
    assert checked.verdict == "fits" and checked.target.num_slices == 1
    provision.run(plan, backend=GkeBackend(kube))
    queue = play.custom.get_cluster_custom_object(
        "kueue.x-k8s.io", "v1beta2", "clusterqueues", "multislice-cluster-queue"
    )
    assert queue["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] == 16

    admitted = admitted_jobset(play, plan, kube)
    assert admitted.admitted and play.jobset(stage.jobset)["spec"]["replicatedJobs"][0]["replicas"] == 1
    pods = play.pods(stage.jobset, 1, plan.slice.hosts, pools=POOLS[:1])
    launched = launch.run(plan, stage, admitted, backend=GkeBackend(kube))
    assert launched.pods == 4 and launched.node_pools == POOLS[:1]
    assert {p.slice for p in launched.placement.values()} == {0}

    def leader_trains():
        for step in range(3):
            play.log(pods[0], step_line(step, 8.0 - step))
            told.wait_for(f"completed step: {step},")
        finishes(play, pods[0], stage.jobset)

    with Background(leader_trains, told):
        trained = train.run(plan, stage, admitted, backend=GkeBackend(kube))
    assert (trained.steps_trained, trained.final_loss, trained.restarts) == (3, 6.0, 0)


# -- the Hugging Face export as a trainer-image Job ----------------------------------------------------------------


def exporter_runs(play, stage, *, verdict="PASS", exit_code=0, report_in_log=True, pod=None):
    """Play the Job controller, the kubelet and the exporter for the stage's verify-and-export Job (its pod
    ``pod`` when the verification already ran in it, else a new one): the pod writes the export and its report to
    the ``gs://`` paths the Job's command names (a scripted exporter: these files, not a conversion), prints both
    reports last (``multislice/trainer/verify_export.py``, ``main``), and ends with ``exit_code``. Returns the
    export's report."""
    if pod is None:
        _, pod = play.job_pod(exporter.job_name(stage))
        play.log(pod, verification_line())
    job = play.batch.api_client.sanitize_for_serialization(
        play.batch.read_namespaced_job(exporter.job_name(stage), "default")
    )
    argv = job["spec"]["template"]["spec"]["containers"][0]["command"]
    output, report_path = argv[argv.index("--output") + 1], argv[argv.index("--report") + 1]
    files = {"config.json": '{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": "weights",
             "tokenizer.json": "{}", "tokenizer_config.json": "{}"}  # fmt: skip
    for name, text in files.items():
        storage.write_text(storage.join(output, name), text)
    check = {"passed": verdict == "PASS", "max_abs_diff": 2.6e-6 if verdict == "PASS" else 0.85, "atol": 1e-3,
             "rtol": 1e-3, "detail": "64 tokens"}  # fmt: skip
    report = {"verdict": verdict, "format": "huggingface", "export_dir": output, "checkpoint_step": stage.final_step,
              "parameter_count": 8030261248, "architecture": "LlamaForCausalLM", "files": sorted(files),
              "logits_check": check}  # fmt: skip
    storage.write_text(report_path, json.dumps(report, indent=1))
    log = verify_export_end(export=report) if report_in_log else "converting layer group 0\n"
    play.job_pod_ends(exporter.job_name(stage), pod, log, exit_code)
    return report


def test_the_verify_step_returns_at_the_verification_and_the_export_step_reads_the_same_job_to_its_end(
    served, play, plan, gcs
):
    """One Job verifies and exports a stage with ``export``: the verify step returns once the pod's log has the
    verification (the Job still running, so the next stage need not wait for the export), and the export step
    renders the same Job, adopts it and reads the export's report when it ends."""
    kube = served.kube()
    stage = stage_of(plan)
    name = f"{stage.jobset}-verify"
    assert exporter.job_name(stage) == name
    reports.write(plan, reports.TrainReport(jobset=stage.jobset, final_loss=5.0, final_eval_loss=5.25), stage)
    started = {}

    def pod_verifies():
        _, started["pod"] = play.job_pod(name)
        play.pod_status(started["pod"], {"phase": "Running"})
        play.log(started["pod"], verification_line())

    with Background(pod_verifies):
        verified = verify_checkpoint.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    assert (verified.verdict, verified.job) == ("PASS", name)
    job = play.batch.read_namespaced_job(name, "default")
    assert jobs.job_state(play.batch.api_client.sanitize_for_serialization(job)) is None  # still exporting
    command = job.spec.template.spec.containers[0].command
    assert command[:3] == ["python", "-m", verify_export.MODULE] and "--output" in command
    assert job.spec.template.spec.node_selector == {"cloud.google.com/gke-nodepool": "export-highmem"}

    with Background(lambda: exporter_runs(play, stage, pod=started["pod"])):
        report = export_step.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    assert (report.verdict, report.job) == ("PASS", name)
    assert [j.metadata.name for j in play.batch.list_namespaced_job("default").items] == [name]  # adopted, one Job
    written = reports.read(reports.VerificationReport, plan, stage)
    assert written is not None and written.verdict == "PASS"


def test_a_failed_verification_ends_the_job_before_any_export_and_fails_the_verify_step(served, play, plan, gcs):
    kube = served.kube()
    stage = stage_of(plan)

    def pod_fails_verification():
        _, pod = play.job_pod(exporter.job_name(stage))
        play.job_pod_ends(exporter.job_name(stage), pod, verification_line("FAIL") + verify_export_end("FAIL"), 1)

    with Background(pod_fails_verification):
        with pytest.raises(verify_checkpoint.VerificationFailed, match="verdict FAIL: latest_step: step 199"):
            verify_checkpoint.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    written = reports.read(reports.VerificationReport, plan, stage)
    assert written is not None and written.verdict == "FAIL"


def test_export_runs_as_a_trainer_job_writes_the_bucket_and_the_model_artifact_names_it(served, play, plan, gcs):
    kube = served.kube()
    stage = stage_of(plan)
    assert stage.export == "huggingface" and stage.export_dtype == "bfloat16"
    reports.write(plan, reports.TrainReport(jobset=stage.jobset, final_loss=5.0, final_eval_loss=5.25), stage)
    with Background(lambda: exporter_runs(play, stage)):
        report = export_step.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    uri = "gs://bucket/runs/r1/llama3-8b/export/huggingface"
    assert (report.verdict, report.export_dir, report.job) == ("PASS", uri, exporter.job_name(stage))

    # The Job the backend created is the rendered one (valid as the API server checks it), on the export pool.
    created = play.batch.api_client.sanitize_for_serialization(
        play.batch.read_namespaced_job(exporter.job_name(stage), "default")
    )
    rendered = exporter.render_job(plan, stage, RUN_ID, reports.model_card(plan, stage))
    command = created["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == rendered["spec"]["template"]["spec"]["containers"][0]["command"]
    card = command[command.index("--run-name") : command.index("--")]  # the model card: from the train report
    assert card == ["--run-name", "r1", "--stage", "llama3-8b", "--steps", "200", "--train-loss", "5.0",
                    "--eval-loss", "5.25"]  # fmt: skip
    assert manifests.object_problems(rendered) == []
    pod = created["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == plan.spec.service_accounts.trainer
    assert pod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "export-highmem"}
    # 8B in bfloat16, a layer group at a time (docs/delivery.md): 12 x 525M + a chunk + 4 GiB, not the model (94Gi)
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "11Gi"
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "31Gi"  # the float32 layers split beside the export
    assert {"name": "TMPDIR", "value": exporter.SCRATCH} in pod["containers"][0]["env"]
    assert created["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID] == RUN_ID

    # The export is in the bucket, the step's report beside the others, and the Model artifact names the URI.
    written = gcs.names(prefix="runs/r1/")
    for name in report.files:
        assert f"runs/r1/llama3-8b/export/huggingface/{name}" in written, name
    assert "runs/r1/reports/llama3-8b/export.json" in written
    metadata = lineage.export_model(stage, report)
    assert metadata["export_uri"] == uri
    assert metadata["source_checkpoint_uri"] == f"gs://bucket/runs/r1/llama3-8b/checkpoints/{stage.final_step}"


def test_export_report_is_read_from_the_bucket_when_the_log_lost_it(served, play, plan):
    kube = served.kube()
    stage = stage_of(plan)
    with Background(lambda: exporter_runs(play, stage, report_in_log=False)):
        report = export_step.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    assert report.verdict == "PASS" and report.export_dir.startswith("gs://bucket/runs/r1/")


def test_export_whose_logits_differ_fails_the_step_with_the_verdict(served, play, plan):
    kube = served.kube()
    stage = stage_of(plan)
    with Background(lambda: exporter_runs(play, stage, verdict="FAIL", exit_code=1)):
        with pytest.raises(export_step.ExportFailed, match="verdict FAIL"):
            export_step.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    job = play.batch.read_namespaced_job(exporter.job_name(stage), "default")
    assert [c.type for c in job.status.conditions] == ["FailureTarget", "Failed"]


def hub_plan(**exporter_fields):
    overrides = {"run_name": "r1", "output_dir": "gs://bucket/runs", "service_accounts.kueue_cluster_objects": True,
                 "stages.0.export_hub_repo": "my-org/llama3-8b-r1",
                 **{f"exporter.{k}": v for k, v in exporter_fields.items()}}  # fmt: skip
    return make_plan(config.load_profile("gke-v6e-16x2-seed", overrides))


def test_export_to_the_hub_takes_its_token_from_a_kubernetes_secret_by_reference():
    plan = hub_plan(hub_token_kubernetes_secret="hf-token")
    job = exporter.render_job(plan, stage_of(plan), RUN_ID)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][container["command"].index("--hub-repo") + 1] == "my-org/llama3-8b-r1"
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}} in (
        container["env"]
    )
    assert manifests.object_problems(job) == []


def test_export_to_the_hub_with_secret_manager_reads_the_token_in_the_pod():
    version = "projects/p/secrets/hf-token/versions/latest"
    plan = hub_plan(hub_token_secret=version)
    container = exporter.render_job(plan, stage_of(plan), RUN_ID)["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:5] == ["python", "-m", "multislice.trainer.hub_token", "--secret-version", version]
    assert container["command"][6:9] == ["python", "-m", verify_export.MODULE]  # verifies, then exports
    assert not any(e["name"] == "HF_TOKEN" for e in container["env"])


def test_export_job_whose_token_secret_is_missing_fails_at_once_naming_it(served, play):
    plan = hub_plan(hub_token_kubernetes_secret="hf-token")
    stage = stage_of(plan)
    kube = served.kube()

    def kubelet_cannot_start():
        _, pod = play.job_pod(exporter.job_name(stage))
        play.job_pod_stuck(pod, "CreateContainerConfigError", 'secret "hf-token" not found')

    with Background(kubelet_cannot_start):
        with pytest.raises(jobs.JobPodStuck, match='secret "hf-token" not found') as caught:
            export_step.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    assert "create it in the namespace" in caught.value.fix
    assert exporter.job_name(stage) not in [j.metadata.name for j in play.batch.list_namespaced_job("default").items]
