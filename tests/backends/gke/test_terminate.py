"""A KFP Terminate at each GKE step: after the bound, nothing of the run is left and one notification was sent.

How a terminate reaches a step (kubeflow/pipelines master, Argo Workflows v4 as KFP vendors it):

- KFP's API server terminates a run by a merge patch ``{"spec": {"activeDeadlineSeconds": 0}}`` of its Argo
  Workflow (``backend/src/apiserver/resource/resource_manager.go``: ``TerminateRun`` -> ``TerminateWorkflow``;
  ``backend/src/common/util/execution_spec.go``: ``GetTerminatePatch``).
- Argo's controller, past the Workflow's deadline, terminates every Pending or Running pod that is not an
  exit-handler pod (``workflow/controller/exec_control.go``: ``applyExecutionControl``, "Terminating pod which
  has exceeded workflow deadline"). ``terminateContainers`` deletes a Pending pod and otherwise sends SIGTERM to
  each running container (``argoexec kill 15 1``), then SIGKILL after the pod's ``terminationGracePeriodSeconds``,
  default 30 s (``workflow/controller/pod/queue.go``: ``signalContainers``; ``workflow/signal/signal.go``).
- Exit handlers: KFP v2 compiles ``dsl.ExitHandler`` into an Argo ``exit`` lifecycle hook
  (``backend/src/v2/compiler/argocompiler/common.go``). Argo v4 exempts exit-handler pods from the deadline
  (``workflow/controller/workflowpod.go``: "ignore the workflow deadline for exit handler so they still run");
  kubeflow/pipelines#10917 reports the exit handler not running after a terminate on earlier versions. So the
  project relies on neither: the run Lease and the reaper end the run, and the exit handler, when it runs,
  is the same end, claimed once.

Here: the step runs in this process against the emulated API and is stopped at one of its cancel points by a
SIGTERM (``MULTISLICE_CANCEL_AT`` without a FIFO: the step signals itself there, :func:`multislice.cancel.point`);
"killed" variants model the SIGKILL after the grace period (the step's own removal never runs). No exit
handler runs until the test calls it. The reaper (:func:`multislice.steps.cleanup.reap_runs` and
:func:`multislice.backends.gke.lease.reap`) is called with an injected clock: just before the run Lease expires
(nothing happens) and at the bound (the run is ended). Node pools are created by provision through
google-cloud-container against the GKE fake (tests/gke_fake.py), labelled with the run id.
"""

from __future__ import annotations

import datetime
import functools

import pytest

from multislice import cancel, config, names
from multislice.backends.base import TrainingFailed
from multislice.backends.gke import GkeBackend, lease, nodepool
from multislice.backends.gke import jobset as jobsets
from multislice.steps import admit, cleanup, launch, preflight, prepare_data, provision, train, verify_checkpoint
from multislice.steps import plan as plan_step
from tests.backends.gke.harness import RUN_ID, Background, stage_of
from tests.backends.gke.test_steps import FITS, admitted_jobset, compile_job_finishes, finishes, running_pods
from tests.fakes import FakeServer
from tests.gke_fake import FakeGke
from tests.kube_controllers import step_line

pytestmark = pytest.mark.usefixtures("crd_schemas", "least_privilege", "run_storage")

OVERRIDES = {"run_name": "r1", "output_dir": "gs://bucket/runs", "service_accounts.kueue_cluster_objects": True}
#: Where each step is terminated: a cancel point inside it, after it took its hold and created what it creates.
POINTS = {
    "plan": "plan:report",
    "prepare_data": "prepare_data:holding",
    "preflight": "preflight:report",
    "provision": "provision:report",
    "admit": "admit:waiting",
    "launch": "launch:waiting",
    "train": "train:following",
    "verify_checkpoint": "verify_checkpoint:start",
}
ORDER = list(POINTS)


@pytest.fixture
def gke(plan, monkeypatch):
    """The GKE API fake for the profile's cluster; provision's ``ensure_node_pools`` polls it without a pause.

    Holds a pool created for another pipeline run and one created outside any run: neither may be deleted.
    """
    cluster = plan.spec.cluster
    fake = FakeGke(cluster.project, cluster.location, cluster.name).start()
    from google.cloud import container_v1

    shape = nodepool.PoolShape.of(plan)
    fake.add_pool(nodepool.node_pool_body("other-run-pool", shape, "run-2222"))
    fake.add_pool(nodepool.node_pool_body("platform-pool", shape))
    # The export Jobs' pool (exporter.node_selector), which provision checks holds them (test_export_pool.py).
    export = container_v1.NodeConfig(machine_type="n2-highmem-16", disk_size_gb=600)
    fake.add_pool(container_v1.NodePool(name="export-highmem", config=export, locations=["us-east5-b"]))
    assert isinstance(fake.client(), container_v1.ClusterManagerClient)
    monkeypatch.setattr(nodepool, "ensure_node_pools", functools.partial(nodepool.ensure_node_pools, poll_seconds=0))
    yield fake
    fake.stop()


def run_pools(fake: FakeGke, run_id: str = RUN_ID) -> list[str]:
    """The fake's pools labelled with ``run_id``."""
    return sorted(
        name for name, pool in fake.pools.items()
        if pool.get("config", {}).get("resourceLabels", {}).get(nodepool.RUN_LABEL) == run_id
    )  # fmt: skip


def unfinished_workloads(kube) -> list[str]:
    """The run's JobSets not finished and Jobs not finished, by its ``pipeline/runid`` label."""
    selector = jobsets.run_selector(RUN_ID)
    found = [f"JobSet {j['metadata']['name']}" for j in kube.list_jobsets(selector)
             if jobsets.phase(j) not in ("Completed", "Failed")]  # fmt: skip
    for job in kube.batch.list_namespaced_job(kube.namespace, label_selector=selector).items:
        ended = [c for c in (job.status.conditions or []) if c.type in ("Complete", "Failed") and c.status == "True"]
        if not ended:
            found.append(f"Job {job.metadata.name}")
    return found


def backend_for(kube, fake, plan):
    """A GKE backend on the emulated API whose node pool calls go to the GKE fake (as ``GkeBackend.connect``
    gives the reaper and the exit handler: the profile's cluster)."""
    backend = GkeBackend(kube)
    backend.node_pool_client, backend.cluster = fake.client(), plan.spec.cluster
    return backend


def run_until(step, served, play, plan, fake, told, monkeypatch):
    """Run the pipeline's steps in order on GKE, the ``step`` one terminated at its cancel point."""
    kube, stage = served.kube(), stage_of(plan)
    admitted, pods = None, []
    for current in ORDER[: ORDER.index(step) + 1]:
        backend = backend_for(kube, fake, plan)
        if current == step:
            monkeypatch.setenv(cancel.ENV_POINT, POINTS[step])
        if current == "plan":
            plan_step.run(config.read_profile("gke-v6e-16x2-seed"), OVERRIDES, stage.name, RUN_ID, backend=backend)
        elif current == "prepare_data":
            prepare_data.run(plan, stage, RUN_ID, backend=backend)
        elif current == "preflight":
            with Background(lambda: compile_job_finishes(play, plan, stage, FITS)):
                preflight.run(plan, [stage], RUN_ID, backend=backend)
        elif current == "provision":
            provision.run(plan, RUN_ID, backend=backend)
            assert run_pools(fake) == nodepool.pool_names(plan)  # created for this run, labelled with it
        elif current == "admit":
            if step == "admit":  # terminated once its JobSet exists and it waits for admission
                admit.run(plan, stage, RUN_ID, backend=backend)
            else:
                admitted = admitted_jobset(play, plan, kube)
        elif current == "launch":
            if step == "launch":
                launch.run(plan, stage, admitted, backend=backend)
            else:
                pods = running_pods(play, plan)
        elif current == "train":
            play.log(pods[0], step_line(0, 8.0))
            if step == "train":  # terminated while it follows training
                train.run(plan, stage, admitted, backend=backend)
            else:

                def leader_finishes(leader=pods[0]):
                    told.wait_for("completed step: 0,")
                    finishes(play, leader, stage.jobset)

                with Background(leader_finishes, told):
                    train.run(plan, stage, admitted, backend=backend)
        elif current == "verify_checkpoint":
            verify_checkpoint.run(plan, stage, RUN_ID, backend=backend)
    return kube


@pytest.mark.parametrize(
    "step, killed",
    [(step, False) for step in ORDER] + [("admit", True), ("launch", True), ("train", True)],
)
def test_a_kfp_terminate_at_each_step_leaves_nothing_after_the_bound_and_notifies_once(
    step, killed, served, play, plan, gke, told, monkeypatch
):
    if killed:  # SIGKILL after the grace period: the step's own removal never ran
        monkeypatch.setattr(GkeBackend, "delete_matching", lambda self, labels, tell: [])
    with FakeServer() as hook:
        url = f"{hook.url}/hook"
        expected = (cancel.Cancelled, TrainingFailed)
        with pytest.raises(expected):
            run_until(step, served, play, plan, gke, told, monkeypatch)
        monkeypatch.delenv(cancel.ENV_POINT)
        kube = served.kube()
        held = lease.get(kube, lease.run_lease_name(RUN_ID))
        assert held is not None, "the run was held on the cluster when it was terminated"
        holder = held["spec"]["holderIdentity"].split("/")[0]
        assert holder == step or step == "verify_checkpoint"  # terminated at its start: train renewed it last
        renewed = datetime.datetime.fromisoformat(held["spec"]["renewTime"].replace("Z", "+00:00"))
        expires = renewed + datetime.timedelta(seconds=held["spec"]["leaseDurationSeconds"])
        reaper = backend_for(kube, gke, plan)

        # Just before the bound: the reaper ends nothing (a step between two pods looks the same).
        assert cleanup.reap_runs(reaper, now=expires - datetime.timedelta(seconds=1), notify_webhook_url=url) == []
        assert hook.state.hooks == []

        # At the bound: the run's workloads, its own node pools and its hold are gone; one CANCELLED message.
        bound = renewed + datetime.timedelta(seconds=lease.orphan_bound(held["spec"]["leaseDurationSeconds"]))
        [ended] = cleanup.reap_runs(reaper, now=bound, notify_webhook_url=url)
        lease.reap(kube, now=bound, tell=print)
        gke.finish_deletes()  # GKE's DELETE_NODE_POOL operations end
        assert ended["pipeline_run_id"] == RUN_ID and ended["notified"] is True
        assert unfinished_workloads(kube) == []
        assert run_pools(gke) == [] and {"other-run-pool", "platform-pool"} <= set(gke.pools)
        assert lease.get(kube, lease.run_lease_name(RUN_ID)) is None
        [message] = hook.state.hooks
        assert message["status"] == "CANCELLED" and message["run_name"] == "r1"
        assert message["failed_step"] == held["spec"]["holderIdentity"].split("/")[0]

        # An exit handler that runs after all (Argo v4 runs exit hooks past the deadline) sends nothing more,
        # and a later reaper run finds nothing.
        done = cleanup.run("gke", "gs://bucket/runs", "r1", RUN_ID, "CANCELED", backend=reaper, notify_webhook_url=url)
        assert done.notified == "sent already by the reaper" and len(hook.state.hooks) == 1
        assert cleanup.reap_runs(reaper, now=bound + datetime.timedelta(hours=1), notify_webhook_url=url) == []
        assert len(hook.state.hooks) == 1


def test_when_the_exit_handler_runs_it_ends_the_run_and_the_reaper_sends_nothing(
    served, play, plan, gke, told, monkeypatch
):
    """Vertex AI (and Argo v4) run the exit handler on a cancel: it deletes the run's JobSet and its node pools,
    sends the one notification and ends the hold; the reaper, past any bound, has nothing to do."""
    with FakeServer() as hook:
        url = f"{hook.url}/hook"
        with pytest.raises(cancel.Cancelled):
            run_until("launch", served, play, plan, gke, told, monkeypatch)
        monkeypatch.delenv(cancel.ENV_POINT)
        kube = served.kube()
        backend = backend_for(kube, gke, plan)
        done = cleanup.run(
            "gke", "gs://bucket/runs", "r1", RUN_ID, "CANCELLED", backend=backend, notify_webhook_url=url
        )
        gke.finish_deletes()
        assert done.notified is True and [m["status"] for m in hook.state.hooks] == ["CANCELLED"]
        assert {f"node pool {p}" for p in nodepool.pool_names(plan)} <= set(done.deleted)
        assert unfinished_workloads(kube) == [] and run_pools(gke) == []
        late = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=1)
        assert cleanup.reap_runs(backend, now=late, notify_webhook_url=url) == []
        assert len(hook.state.hooks) == 1


def test_a_pool_another_run_uses_is_kept_and_a_finished_run_keeps_its_pools(served, play, plan, gke, monkeypatch):
    """Terminated run A created the pools, run B's pods run on them: they are B's now and stay. A run that ends
    normally keeps the pools it created (capacity for the next run, as before)."""
    kube = served.kube()
    backend = backend_for(kube, gke, plan)
    provision.run(plan, RUN_ID, backend=backend)
    pool = nodepool.pool_names(plan)[0]
    play.core.create_node({"metadata": {"name": "n-0", "labels": {"cloud.google.com/gke-nodepool": pool}}})
    play.core.create_namespaced_pod("default", {
        "metadata": {"name": "b-worker", "labels": {names.LABEL_PIPELINE_RUN_ID: "run-bbbb"}},
        "spec": {"nodeName": "n-0", "containers": [{"name": "c", "image": "i"}]},
    })  # fmt: skip
    deleted, kept = backend.release_node_pools(RUN_ID, print)
    assert deleted == nodepool.pool_names(plan)[1:]
    assert kept == [f"{pool}: pod b-worker of pipeline run run-bbbb runs on it"]
    done = cleanup.run("gke", "gs://bucket/runs", "r1", "run-3333", "SUCCEEDED", backend=backend)
    assert not [d for d in done.deleted if d.startswith("node pool")]
