"""Emergency checkpoints on GKE: the rendered JobSet's local tier, and a restart that restores from it.

The emulated cluster (tests/backends/gke/conftest.py) runs the admit and train steps against the JobSet the plan
renders; the test plays the JobSet controller and the kubelet (tests/kube_controllers.py) and writes the leader's
log as MaxText and Orbax print it (:func:`tests.kube_controllers.restore_lines`). What neither fakes: GKE's
checkpointing CSI driver (the ramdisk that outlives a pod, the ``jax-init-info.txt`` it writes) and Orbax's choice
of tier. The scripted leader states which tier Orbax restored from, as Orbax's ``CheckpointManager.restore`` does:
the newest step of either tier, from a slice holding it locally, else from the persistent tier.
"""

from __future__ import annotations

import pytest

from multislice import config, names
from multislice.backends.gke import GkeBackend
from multislice.delivery import artifacts
from multislice.plan import make_plan
from multislice.render import jobset as render_jobset
from multislice.render import manifests, ray
from multislice.steps import train
from tests.backends.gke.harness import POOLS, RUN_ID, Background, admitted, stage_of
from tests.kube_controllers import restore_lines, step_line, worker_start_line

pytestmark = pytest.mark.usefixtures("crd_schemas", "least_privilege", "run_storage", "node_pools")


@pytest.fixture
def plan():
    """The GKE profile's 8B stage on 2 x v6e-16 with a local checkpoint every 10 steps (persistent every 50)."""
    spec = config.load_profile(
        "gke-v6e-16x2-seed",
        {
            "run_name": "r1",
            "output_dir": "gs://bucket/runs",
            "service_accounts.kueue_cluster_objects": True,
            "stages.0.elastic": None,
            "stages.0.emergency_checkpoint": {"local_period": 10},
        },
    )
    return make_plan(spec)


def lost_then_restored(play, plan, told, js, first, before: str, after: str, lost_pod: int, last: tuple[int, int]):
    """Attempt 0 logs ``before``; pod ``lost_pod`` of it is killed (exit 137, its node lost); the JobSet restarts;
    attempt 1's leader logs ``after`` and the JobSet completes. ``last``: each attempt's last step logged."""
    play.log(first[0], worker_start_line() + restore_lines(None) + before)
    told.wait_for(rf"completed step: {last[0]},")
    terminated = {"name": names.TRAINER_CONTAINER, "ready": False, "restartCount": 0, "image": "t", "imageID": "",
                  "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}  # fmt: skip
    play.pod_status(first[lost_pod], {"phase": "Failed", "containerStatuses": [terminated]})
    play.patch_jobset(js, {"status": {"restarts": 1}}, status=True)
    told.wait_for(r"JobSet restarted \(1/")
    # restartStrategy Recreate: the JobSet controller deletes every child Job of the attempt, and their pods go
    # (kubernetes-sigs/jobset v0.12.0 pkg/controllers/jobset_controller.go, deleteJobs)
    for pod in first:
        if pod != first[lost_pod]:
            play.core.delete_namespaced_pod(pod, play.ns)
    second = play.pods(js, 2, plan.slice.hosts, attempt=1, pools=POOLS)
    play.log(second[0], worker_start_line() + after)
    told.wait_for(rf"completed step: {last[1]},")
    play.pod_status(second[0], {"phase": "Succeeded"})
    play.jobset_done(js, "Completed", "AllJobsCompleted", "jobset completed successfully")


def test_the_rendered_jobset_mounts_the_checkpoint_ramdisk_and_validates_against_the_crds(plan):
    stage = stage_of(plan)
    obj = render_jobset.render_jobset(plan, stage, hardware="tpu", pipeline_run_id=RUN_ID)
    assert manifests.object_problems(obj) == []  # JobSet v0.12.0's CRD and the pod checks
    pod = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert {"name": "local-checkpoints", "csi": {"driver": "multitier-checkpoint.csi.storage.gke.io"}} in pod["volumes"]
    assert {"name": "local-checkpoints", "mountPath": "/local"} in container["volumeMounts"]
    args = container["args"]
    for arg in ("enable_emergency_checkpoint=true", "local_checkpoint_directory=/local", "local_checkpoint_period=10",
                "checkpoint_period=50", "jax_cache_dir=gs://bucket/runs/r1/jax_cache"):  # fmt: skip
        assert arg in args, arg
    assert next(a for a in args if a.startswith("mesh_axes=")).startswith("mesh_axes=[data,diloco,")
    # The CPU variant (CPU nodes have no checkpoint ramdisk) checkpoints to the persistent tier only.
    cpu = render_jobset.render_jobset(plan, stage, hardware="cpu", pipeline_run_id=RUN_ID)
    cpu_pod = cpu["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert not [a for a in cpu_pod["containers"][0]["args"] if "emergency" in a or "local_checkpoint" in a]
    assert all("csi" not in volume for volume in cpu_pod["volumes"])


def test_a_restart_after_a_pod_loss_restores_from_the_local_tier(served, play, plan, told):
    kube = served.kube()
    admit_report = admitted(play, plan, kube)
    js = stage_of(plan).jobset
    created = play.jobset(js)  # what the API server holds carries the volume
    volumes = created["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "local-checkpoints", "csi": {"driver": "multitier-checkpoint.csi.storage.gke.io"}} in volumes
    first = play.pods(js, 2, plan.slice.hosts, attempt=0, pools=POOLS)

    def script():
        lost_then_restored(
            play, plan, told, js, first,
            before=step_line(23, 6.1) + step_line(24, 6.0),
            # a pod of slice 1 was lost; slice 1's other hosts and every node's ramdisk kept step 20
            after=restore_lines(20, "local", slice_id=1) + step_line(21, 6.2) + step_line(26, 5.9),
            lost_pod=plan.slice.hosts,  # slice 1, host 0
            last=(24, 26),
        )  # fmt: skip

    with Background(script, told):
        trained = train.run(plan, stage_of(plan), admit_report, backend=GkeBackend(kube))
    assert trained.restores == [
        {"attempt": 0, "step": None},
        {"attempt": 1, "step": 20, "tier": "local", "slice": 1},
    ]
    assert "attempt 1 restored from the local tier at step 20 (slice 1)" in told.lines
    assert "| 1 | 20 | local | 1 |" in artifacts.train_markdown(stage_of(plan).name, trained)  # the run summary page
    assert trained.restarts == 1


def test_without_a_local_copy_the_restart_falls_back_to_the_persistent_tier(served, play, plan, told):
    kube = served.kube()
    admit_report = admitted(play, plan, kube)
    js = stage_of(plan).jobset
    first = play.pods(js, 2, plan.slice.hosts, attempt=0, pools=POOLS)
    persistent = stage_of(plan).checkpoint_dir

    def script():
        lost_then_restored(
            play, plan, told, js, first,
            before=step_line(56, 5.1) + step_line(57, 5.0),
            # slice 1's node pool was replaced (Spot) and its ramdisks with it: slice 0 writes only the persistent
            # tier, so no slice holds step 50 locally and Orbax reads it from the checkpoint directory
            after=restore_lines(50, "persistent", directory=persistent) + step_line(51, 5.2) + step_line(58, 4.9),
            lost_pod=plan.slice.hosts,
            last=(57, 58),
        )  # fmt: skip

    with Background(script, told):
        trained = train.run(plan, stage_of(plan), admit_report, backend=GkeBackend(kube))
    assert trained.restores == [{"attempt": 0, "step": None}, {"attempt": 1, "step": 50, "tier": "persistent"}]
    assert "attempt 1 restored from the persistent tier at step 50" in told.lines


def test_every_tpu_workload_compiles_through_the_runs_cache_in_cloud_storage():
    """The persistent compilation cache on GKE: the TPU JobSet's pods and the RayJob's workers (through the driver's
    arguments) give MaxText ``jax_cache_dir=gs://<bucket>/<runs>/<run>/jax_cache``, the same for every stage."""
    spec = config.load_profile("gke-v6e-16x2-seed", {"run_name": "r1", "output_dir": "gs://bucket/runs"})
    plan, ray_plan = make_plan(spec), make_plan(spec.model_copy(update={"launcher": "ray"}))
    wanted = "jax_cache_dir=gs://bucket/runs/r1/jax_cache"
    for stage, ray_stage in zip(plan.stages, ray_plan.stages, strict=True):
        tpu = render_jobset.render_jobset(plan, stage, hardware="tpu", pipeline_run_id=RUN_ID)
        [container] = tpu["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
        assert wanted in container["args"]
        assert ray_stage.launcher == "ray"
        rayjob = ray.render_rayjob(ray_plan, ray_stage, pipeline_run_id=RUN_ID)
        assert wanted in rayjob["spec"]["entrypoint"].split()


def test_both_production_stages_render_multi_tier_checkpoints_that_validate_against_the_crds():
    """gke-v6e-16x2: the elastic 8B and the DCN-FSDP 70B (one data-parallel replica) each get MaxText's multi-tier
    checkpointing (multislice.plan.emergency_checkpoint_args says why not Orbax's emergency manager), the checkpoint
    ramdisk in every TPU pod, and no local tier on CPU."""
    plan = make_plan(config.load_profile("gke-v6e-16x2", {"run_name": "r1", "output_dir": "gs://bucket/runs"}))
    expected = {"llama3-8b": ("10", "2"), "llama3-70b": ("5", "1")}
    for stage in plan.stages:
        obj = render_jobset.render_jobset(plan, stage, hardware="tpu", pipeline_run_id=RUN_ID)
        assert manifests.object_problems(obj) == []  # JobSet v0.12.0's CRD and the pod checks
        pod = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        [container] = pod["containers"]
        assert {"name": "local-checkpoints", "csi": {"driver": "multitier-checkpoint.csi.storage.gke.io"}} in (
            pod["volumes"]
        )
        assert {"name": "local-checkpoints", "mountPath": "/local"} in container["volumeMounts"]
        args = dict(a.split("=", 1) for a in container["args"] if "=" in a)
        period, replicas = expected[stage.name]
        assert (args["enable_multi_tier_checkpointing"], args["local_checkpoint_period"]) == ("true", period)
        assert (args["mtc_data_parallelism"], args["checkpoint_period"]) == (replicas, "50")
        assert "enable_emergency_checkpoint" not in args and "mesh_axes" not in args
        cpu = render_jobset.render_jobset(plan, stage, hardware="cpu", pipeline_run_id=RUN_ID)
        cpu_args = cpu["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert not [a for a in cpu_args if "multi_tier" in a or "local_checkpoint" in a or "mtc_" in a]
    # The elastic stage on one slice: one replica, the same persistent layout (tiered_checkpoint's <step>/default).
    [one] = [count for count in plan.stages[0].elastic if count.slices == 1]
    assert "mtc_data_parallelism=1" in one.maxtext_args and "enable_multi_tier_checkpointing=true" in one.maxtext_args
