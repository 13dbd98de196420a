"""The GKE steps for a stage launched by Ray (``launcher: ray``): a KubeRay RayJob, over real HTTP.

As in tests/backends/gke/test_steps.py: kmock's emulator (tests/kube_cluster.py), the steps acting as the pipeline's
ServiceAccount under the rendered RBAC, and controller scripts (tests/kube_controllers.py: Kueue's RayJob
integration and KubeRay, :class:`tests.kube_controllers.KubeRay`) that wait for the step to tell what it
observed before their next change.
"""

from __future__ import annotations

import os
import signal

import pytest

from multislice import config, names
from multislice.backends.base import LaunchFailed, TrainingFailed
from multislice.backends.gke import GkeBackend, rayjob
from multislice.backends.gke import jobset as jobsets
from multislice.plan import make_plan
from multislice.render import ray as render_ray
from multislice.render import rbac, schema
from multislice.steps import admit, cleanup, launch, provision, train
from tests.backends.gke.harness import POOLS, RUN_ID, Background, stage_of
from tests.kube_controllers import KubeRay, step_line
from tests.kube_rbac import service_account_user

# The emulated cluster (served, play), the told lines, the run's storage and the node pools: the GKE scenarios'
# fixtures (tests/backends/gke/conftest.py); crd_schemas, plan and least_privilege are this module's own below.
pytestmark = pytest.mark.usefixtures("run_storage", "node_pools")

#: Every stage launched by Ray, on node pools with an extra network for DCN (DRANET claim templates).
OVERRIDES = {
    "run_name": "r1",
    "output_dir": "gs://bucket/runs",
    "service_accounts.kueue_cluster_objects": True,
    "launcher": "ray",
    "node_pools.additional_node_networks": [{"network": "dcn-net", "subnetwork": "dcn-sub"}],
    # Workers claiming DRANET devices must be off the host network (DRANET refuses hostNetwork pods).
    "service_accounts.tpu_host_network": False,
}


@pytest.fixture(scope="module", autouse=True)
def crd_schemas():
    """The CRD validators built before the first scenario (see test_steps.py's fixture of that name)."""
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed", OVERRIDES))
    schema.validate(render_ray.render_rayjob(plan, plan.stages[0], pipeline_run_id=RUN_ID))
    for obj in provision.kueue_objects(plan):
        schema.validate(obj)


@pytest.fixture
def plan():
    return make_plan(config.load_profile("gke-v6e-16x2-seed", OVERRIDES))


@pytest.fixture(autouse=True)
def least_privilege(served, plan):
    """The steps act as the pipeline's ServiceAccount under the RBAC `multislice render` writes for a Ray run."""
    accounts = plan.spec.service_accounts
    user = service_account_user(accounts.pipeline_namespace or plan.spec.namespace, accounts.pipeline)
    served.as_user(user, rbac.render_rbac_objects(plan))
    return served.cluster.authorizer


def kuberay(play, plan) -> KubeRay:
    return KubeRay(play, stage_of(plan).jobset, plan.spec.num_slices, plan.slice.hosts, POOLS)


def admitted(play, plan, kube, told, pending: str | None = None):
    """admit with Kueue's RayJob integration queueing then admitting the RayJob."""
    ray = kuberay(play, plan)

    def kueue():
        ray.kueue_queues(pending or "waiting")
        if pending:
            told.wait_for(r"waiting for admission \(\d+ s\): QuotaReserved False: Pending: " + pending)
        ray.kueue_admits()

    with Background(kueue, told):
        report = admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(kube))
    return report, ray


def launched(play, plan, kube, told):
    """admit, then launch while KubeRay creates the RayCluster's pods: ``(admit report, KubeRay, workers)``."""
    report, ray = admitted(play, plan, kube, told)
    workers: list[str] = []
    with Background(lambda: workers.extend(ray.starts()), told):
        running = launch.run(plan, stage_of(plan), report, backend=GkeBackend(kube))
    assert running.pods == plan.spec.num_slices * plan.slice.hosts and running.node_pools == POOLS
    return report, ray, workers


def leader() -> str:
    """The line the leader of each worker group attempt prints (the driver passes its workers' lines on unprefixed,
    docs/architecture.md "The Ray launcher")."""
    return "multislice ray worker: rank 0 of 8 (slice 0, host 0) pid 41\n"


def test_rayjob_admitted_by_kueue_launched_and_succeeded(served, play, plan, told, capsys):
    kube = served.kube()
    message = "couldn't assign flavors to pod set slice: insufficient quota for google.com/tpu in flavor v6e-4x4"
    report, ray = admitted(play, plan, kube, told, pending=message)
    assert report.admitted and report.workload == ray.workload and report.cluster_queue == "multislice-cluster-queue"
    stored = rayjob.get(kube, stage_of(plan).jobset)
    labels = stored["metadata"]["labels"]
    assert labels[names.KUEUE_QUEUE_LABEL] == plan.spec.queue and labels[names.LABEL_PIPELINE_RUN_ID] == RUN_ID
    assert stored["metadata"]["annotations"][jobsets.SPEC_HASH_ANNOTATION]
    template = play.custom.get_namespaced_custom_object(
        "resource.k8s.io", "v1", "default", "resourceclaimtemplates", render_ray.claim_template_name(stage_of(plan))
    )
    assert template["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID] == RUN_ID
    assert f"QuotaReserved False: Pending: {message}" in capsys.readouterr().out

    again = admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(kube))  # a retried step adopts it
    assert again.adopted and again.admitted

    workers: list[str] = []
    with Background(lambda: workers.extend(ray.starts()), told):
        running = launch.run(plan, stage_of(plan), report, backend=GkeBackend(kube))
    assert running.pods == 8 and running.node_pools == POOLS
    assert {p.node_pool for name, p in running.placement.items() if p.slice == 1} == {"tpu-pool-1"}

    def driver_trains():
        ray.driver_logs("Job submission server address: http://r1-llama3-8b-x7k2p-head-svc:8265\n" + leader())
        for step in range(3):
            ray.driver_logs(step_line(step, 8.0 - step))
            told.wait_for(f"completed step: {step},")
        ray.job_ends("SUCCEEDED")

    with Background(driver_trains, told):
        trained = train.run(plan, stage_of(plan), report, backend=GkeBackend(kube))
    assert (trained.steps_trained, trained.first_loss, trained.final_loss) == (3, 8.0, 6.0)
    assert trained.restarts == 0 and trained.leader_logs == [ray.submitter_pod] and trained.launcher == "ray"

    done = cleanup.run("gke", "gs://bucket/runs", "r1", RUN_ID, "SUCCEEDED", backend=GkeBackend(kube))
    assert done.kept == [stage_of(plan).jobset]
    assert done.deleted == [f"ResourceClaimTemplate {render_ray.claim_template_name(stage_of(plan))}"]


def test_dranet_starts_the_rendered_workers_and_would_refuse_them_on_the_host_network(served, play, plan, told):
    """The workers claim DRANET devices off the host network, and start. The same RayJob with hostNetwork (what
    was rendered before: the default tpu_host_network) never starts a worker: the emulated DRANET refuses each
    pod's sandbox as google/dranet's RunPodSandbox hook does (pkg/driver/nri_hooks.go), KubeRay submits nothing."""
    kube = served.kube()
    _, ray = admitted(play, plan, kube, told)
    template = ray.rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert template["resourceClaims"] and "hostNetwork" not in template
    group = ray.rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    group["template"]["spec"]["hostNetwork"] = True
    ray.patch({"spec": {"rayClusterSpec": {"workerGroupSpecs": [group]}}})
    workers = ray.starts()
    pod = play.core.read_namespaced_pod(workers[0], "default")
    assert pod.status.phase == "Pending"
    assert pod.status.container_statuses[0].state.waiting.reason == "ContainerCreating"
    (event,) = [e for e in play.core.list_namespaced_event("default").items if e.involved_object.name == workers[0]]
    assert event.reason == "FailedCreatePodSandBox" and "using host network can not claim host devices" in event.message
    assert ray.rayjob()["status"]["jobDeploymentStatus"] == "Initializing"
    assert not play.batch.list_namespaced_job("default").items  # no submitter before the cluster is ready


def test_a_killed_worker_that_ray_train_recovers_is_not_a_failure(served, play, plan, told, capsys):
    kube = served.kube()
    report, ray, workers = launched(play, plan, kube, told)

    def worker_lost_then_recovered():
        ray.driver_logs(leader() + step_line(0, 8.0))
        told.wait_for("completed step: 0,")
        killed = ray.worker_killed(1, 2)
        told.wait_for(rf"Ray worker pod {killed} \(slice 1, host 2\) failed \(exit code 137\)")
        ray.worker_replaced(1, 2)
        ray.driver_logs(
            "multislice ray driver: worker group failed (RayActorError); FailureConfig retries it\n"
            + leader()
            + step_line(1, 7.0)
        )
        told.wait_for(r"Ray Train restarted the worker group \(1/4 failures\)")
        told.wait_for("completed step: 1,")
        ray.job_ends("SUCCEEDED")

    with Background(worker_lost_then_recovered, told):
        trained = train.run(plan, stage_of(plan), report, backend=GkeBackend(kube))
    assert trained.restarts == 1 and trained.steps_trained == 2
    out = capsys.readouterr().out
    assert "KubeRay replaces it and Ray Train retries the worker group (max_failures 4)" in out


def test_a_retried_submitter_replaying_the_log_passes_no_line_twice(served, play, plan, told):
    kube = served.kube()
    report, ray, workers = launched(play, plan, kube, told)

    def submitter_lost():
        first = ray.submitter_pod
        ray.driver_logs(leader() + step_line(0, 8.0) + step_line(1, 7.5))
        told.wait_for("completed step: 1,")
        second = ray.submitter_retried()  # its log starts with the first pod's three lines again
        told.wait_for(f"submitter pod {second} follows the Ray job's log again")
        ray.driver_logs(step_line(2, 7.0))
        told.wait_for("completed step: 2,")
        ray.job_ends("SUCCEEDED")
        assert first != second

    with Background(submitter_lost, told):
        trained = train.run(plan, stage_of(plan), report, backend=GkeBackend(kube))
    assert (trained.steps_trained, trained.first_loss, trained.final_loss) == (3, 8.0, 7.0)
    assert trained.restarts == 0 and len(trained.leader_logs) == 2


def test_evicted_by_kueue_then_readmitted_the_rayjob_trains_on_a_new_raycluster(served, play, plan, told, capsys):
    kube = served.kube()
    report, ray, workers = launched(play, plan, kube, told)

    def preempted_then_resumed():
        ray.driver_logs(leader() + step_line(0, 8.0))
        told.wait_for("completed step: 0,")
        ray.kueue_evicts("Preempted to accommodate a workload (UID: 42) due to prioritization in the ClusterQueue")
        told.wait_for(r"RayJob suspended by Kueue \(Evicted True: Preempted: ")
        ray.kueue_admits()
        told.wait_for("RayJob admitted again after")
        ray.starts()  # a new RayCluster, a new submitter; the new Ray job restores step 0's checkpoint
        ray.driver_logs(leader() + step_line(1, 7.0))
        told.wait_for("completed step: 1,")
        ray.job_ends("SUCCEEDED")

    with Background(preempted_then_resumed, told):
        trained = train.run(plan, stage_of(plan), report, backend=GkeBackend(kube))
    assert trained.steps_trained == 2 and trained.final_loss == 7.0
    assert trained.leader_logs == [f"{ray.name}-sbm4t", ray.submitter_pod]
    assert "RayJob admitted again after" in capsys.readouterr().out


def test_a_failed_ray_job_fails_train_with_its_cause(served, play, plan, told):
    kube = served.kube()
    report, ray, workers = launched(play, plan, kube, told)
    cause = "Job entrypoint command failed with exit code 1, last available logs: RESOURCE_EXHAUSTED: out of HBM"

    def fails():
        ray.driver_logs(leader() + step_line(0, 8.0))
        told.wait_for("completed step: 0,")
        ray.driver_logs("multislice ray driver: training failed: TrainingFailedError: RESOURCE_EXHAUSTED\n")
        ray.worker_killed(0, 0, exit_code=1)
        ray.job_ends("FAILED", cause)

    with pytest.raises(TrainingFailed) as failure, Background(fails, told):
        train.run(plan, stage_of(plan), report, backend=GkeBackend(kube))
    text = str(failure.value)
    status = "Failed (jobDeploymentStatus Failed, jobStatus FAILED)"
    assert f"RayJob {stage_of(plan).jobset} {status}: AppFailed: {cause}" in text
    assert "multislice ray driver: training failed: TrainingFailedError" in text  # the submitter's log tail
    assert f"Ray worker pod {ray.worker_name(0, 0)} (slice 0, host 0) exit code 1" in text


def test_a_rayjob_failed_before_its_pods_ran_fails_launch(served, play, plan, told):
    kube = served.kube()
    report, ray = admitted(play, plan, kube, told)
    ray.job_ends("FAILED", "RayCluster head pod failed to start", reason="SubmissionFailed")
    with pytest.raises(LaunchFailed, match="SubmissionFailed: RayCluster head pod failed to start"):
        launch.run(plan, stage_of(plan), report, backend=GkeBackend(kube))


def test_cancelled_rayjob_is_deleted_and_nothing_of_the_run_is_left(served, play, plan, told):
    kube = served.kube()
    report, ray, workers = launched(play, plan, kube, told)

    def cancelled_while_following():
        ray.driver_logs(leader() + step_line(0, 8.0))
        told.wait_for("completed step: 0,")
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingFailed, match=f"cancelled; {stage_of(plan).jobset} deleted"):
        with Background(cancelled_while_following, told):
            train.run(plan, stage_of(plan), report, backend=GkeBackend(kube))
    assert rayjob.get(kube, stage_of(plan).jobset) is None
    ray.garbage_collected()

    done = cleanup.run("gke", "gs://bucket/runs", "r1", RUN_ID, "CANCELLED", backend=GkeBackend(kube))
    assert done.kept == [] and done.deleted == []  # train's cancellation deleted the RayJob and its claim template
    selector = f"{names.LABEL_PIPELINE_RUN_ID}={RUN_ID}"
    for group, version, plural in (("ray.io", "v1", "rayjobs"), ("ray.io", "v1", "rayclusters"),
                                   ("resource.k8s.io", "v1", "resourceclaimtemplates"),
                                   ("kueue.x-k8s.io", "v1beta2", "workloads")):  # fmt: skip
        assert play.custom.list_namespaced_custom_object(group, version, "default", plural)["items"] == [], plural
    assert play.core.list_namespaced_pod("default", label_selector=f"ray.io/cluster={ray.cluster}").items == []
    assert play.core.list_namespaced_pod("default", label_selector=f"job-name={ray.name}").items == []
    assert play.batch.list_namespaced_job("default", label_selector=selector).items == []
    assert play.batch.list_namespaced_job("default").items == []


def test_the_reaper_deletes_an_unfinished_rayjob_whose_lease_expired_and_spares_a_finished_one(
    served, play, plan, told
):
    """A step killed without its handlers stops renewing the Lease the RayJob owns; ``multislice reap`` deletes it."""
    import datetime

    from multislice.backends.gke import lease

    kube, name = served.kube(), stage_of(plan).jobset
    admitted(play, plan, kube, told)
    held = lease.renew(kube, name, "train/pod-1", seconds=3)
    assert held["metadata"]["ownerReferences"][0]["kind"] == "RayJob"  # the garbage collector removes it with it
    renewed = datetime.datetime.fromisoformat(held["spec"]["renewTime"].replace("Z", "+00:00"))
    assert lease.reap(kube, now=renewed + datetime.timedelta(seconds=1), tell=print) == []  # still held
    late = renewed + datetime.timedelta(seconds=lease.orphan_bound(3))
    kuberay(play, plan).job_ends("SUCCEEDED")
    assert lease.reap(kube, now=late, tell=print) == []  # finished: holds no TPUs, kept as cleanup keeps it
    kuberay(play, plan).patch({"status": {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}}, status=True)
    assert lease.reap(kube, now=late, tell=print) == [name]
    assert rayjob.get(kube, name) is None and lease.get(kube, name) is None


def test_provision_for_a_ray_run_needs_kuberays_rayjob_crd(served, plan):
    from multislice.backends.gke import cluster
    from tests.kube_controllers import Play

    Play(served).install_crds(skip=("rayjobs.ray.io",))
    with pytest.raises(
        cluster.CrdsMissing, match=r"rayjobs\.ray\.io needs v1, the cluster serves nothing.*Ray operator add-on"
    ):
        provision.run(plan, backend=GkeBackend(served.kube()))
