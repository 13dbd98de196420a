"""The Ray launcher (launcher: ray): config option, rendered RayJob and DRANET claims, the driver's pure parts."""

from __future__ import annotations

import json
import shlex

import pytest

from multislice import config, tpu
from multislice.config import ConfigError
from multislice.plan import make_plan
from multislice.render import jobset, launchers, manifests, ray
from multislice.trainer import ray_driver, ray_job

NETWORKS = [{"network": "dcn-net", "subnetwork": "dcn-sub"}, {"network": "dcn-net-2", "subnetwork": "dcn-sub-2"}]
#: Workers that claim DRANET devices off the host network (DRANET refuses hostNetwork pods), writing gs:// through
#: Workload Identity.
OFF_HOST = {"tpu_host_network": False, "tpu_workload_identity": True}


def _plan(profile: str = "gke-v6e-16x2-seed", **changes):
    data = config.spec_to_data(config.load_profile(profile))
    data.update(changes)
    return make_plan(config.load_spec(data))


def test_launcher_is_a_run_parameter_and_a_stage_option():
    spec = config.load_profile("local")
    assert spec.launcher == "jobset"
    changed = config.load_spec(
        config.apply_overrides(config.spec_to_data(spec), config.parse_set_arguments(["launcher=ray"]))
    )
    assert [s.launcher for s in make_plan(changed).stages] == ["ray", "ray"]
    per_stage = config.load_spec(
        config.apply_overrides(config.spec_to_data(spec), config.parse_set_arguments(["stages.1.launcher=ray"]))
    )
    assert [s.launcher for s in make_plan(per_stage).stages] == ["jobset", "ray"]


def test_unknown_launcher_names_the_field():
    spec = config.load_profile("local")
    with pytest.raises(ConfigError, match="launcher"):
        config.load_spec(
            config.apply_overrides(config.spec_to_data(spec), config.parse_set_arguments(["launcher=mpi"]))
        )


def test_min_slices_above_num_slices_is_refused():
    with pytest.raises(ConfigError, match="ray.min_slices"):
        _plan(ray={"min_slices": 3})


def test_rayjob_has_one_tpu_worker_group_per_slice_type():
    plan = _plan(launcher="ray")
    stage = plan.stages[1]
    job = ray.render_rayjob(plan, stage, pipeline_run_id="run-1")
    assert manifests.object_problems(job) == []
    labels = job["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == plan.spec.queue
    assert labels["pipeline/runid"] == "run-1"
    cluster = job["spec"]["rayClusterSpec"]
    (group,) = cluster["workerGroupSpecs"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 2, 2)
    assert group["numOfHosts"] == plan.slice.hosts == 4
    pod = group["template"]["spec"]
    assert pod["nodeSelector"] == {tpu.ACCELERATOR_LABEL: "tpu-v6e-slice", tpu.TOPOLOGY_LABEL: "4x4"}
    (worker,) = pod["containers"]
    assert worker["resources"]["limits"] == {tpu.TPU_RESOURCE: 4}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert not any(e["name"].startswith("MEGASCALE_") for e in worker.get("env", []))  # Ray Train sets them
    assert "resourceClaims" not in pod  # no additional networks in this profile
    assert job["spec"]["shutdownAfterJobFinishes"] is True
    assert cluster["enableInTreeAutoscaling"] is False  # Kueue's RayJob integration needs it off
    command = shlex.split(job["spec"]["entrypoint"])
    assert command[:3] == ["python", "-m", ray.DRIVER_MODULE]
    options, maxtext_args = ray_driver.parse_args(command[3:])
    assert (options.slices, options.hosts_per_slice, options.chips_per_host) == (2, 4, 4)
    assert options.max_failures == plan.spec.max_restarts
    assert options.storage_path == stage.checkpoint_dir
    assert (options.tpu, options.topology, options.accelerator_type) == (True, "4x4", "TPU-V6E")
    assert maxtext_args == stage.maxtext_args
    assert "dcn_fsdp_parallelism=2" in maxtext_args


def test_ray_workers_use_the_host_network_as_the_jobset_and_the_head_its_cpu_node_pool():
    """As the JobSet's TPU pods: hostNetwork with cluster DNS (the workers reach the head's Service by name); with
    tpu_workload_identity, the pod network. The head runs where ray.head_node_selector says, never on the host
    network. The RayJob validates against KubeRay v1.7.0's CRD either way."""
    plan = _plan(launcher="ray")
    cluster = ray.render_rayjob(plan, plan.stages[0], pipeline_run_id="r")["spec"]["rayClusterSpec"]
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    assert worker["hostNetwork"] is True and worker["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert head["nodeSelector"] == {"cloud.google.com/gke-nodepool": "cpu-pool"} and "hostNetwork" not in head
    jobset_pod = jobset.render_jobset(plan, plan.stages[0], hardware="tpu", pipeline_run_id="r")
    jobset_pod = jobset_pod["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert (jobset_pod["hostNetwork"], jobset_pod["dnsPolicy"]) == (worker["hostNetwork"], worker["dnsPolicy"])
    data = config.spec_to_data(config.load_profile("gke-v6e-16x2-seed"))
    accounts = {**data["service_accounts"], "tpu_host_network": False, "tpu_workload_identity": True}
    identity = _plan(launcher="ray", service_accounts=accounts)
    job = ray.render_rayjob(identity, identity.stages[0], pipeline_run_id="r")
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert "hostNetwork" not in worker and "dnsPolicy" not in worker
    assert manifests.object_problems(job) == []


def test_additional_networks_give_dranet_claims_and_the_node_label():
    from multislice.backends.gke import nodepool

    data = config.spec_to_data(config.load_profile("gke-v6e-16x2-seed"))
    accounts = {**data["service_accounts"], **OFF_HOST}
    pools = {**data["node_pools"], "additional_node_networks": NETWORKS}
    plan = _plan(launcher="ray", node_pools=pools, service_accounts=accounts)
    stage = plan.stages[0]
    (claim,) = ray.render_claim_templates(plan, stage, pipeline_run_id="run-1")
    assert manifests.object_problems(claim) == []
    (request,) = claim["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "netdev.google.com", "allocationMode": "ExactCount", "count": 2}
    pod = ray.render_rayjob(plan, stage, pipeline_run_id="run-1")["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    pod = pod["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": ray.DCN_CLAIM, "resourceClaimTemplateName": claim["metadata"]["name"]}]
    assert pod["containers"][0]["resources"]["claims"] == [{"name": ray.DCN_CLAIM}]
    assert "hostNetwork" not in pod  # DRANET moves the NICs into the pod's network namespace
    body = nodepool.node_pool_body("tpu-v6e-4x4-0", nodepool.PoolShape.of(plan))
    assert dict(body.config.labels) == {"cloud.google.com/gke-networking-dra-driver": "true"}
    assert "--node-labels=cloud.google.com/gke-networking-dra-driver=true" in nodepool.gcloud_create_args(
        plan, "tpu-v6e-4x4-0"
    )


def test_a_bad_claim_template_is_refused():
    data = config.spec_to_data(config.load_profile("gke-v6e-16x2-seed"))
    accounts = {**data["service_accounts"], **OFF_HOST}
    pools = {**data["node_pools"], "additional_node_networks": NETWORKS[:1]}
    plan = _plan(launcher="ray", node_pools=pools, service_accounts=accounts)
    (claim,) = ray.render_claim_templates(plan, plan.stages[0], pipeline_run_id="run-1")
    claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = 0
    claim["spec"]["spec"]["devices"]["requests"][0]["deviceclass"] = "x"
    found = manifests.object_problems(claim)
    assert any("count" in p for p in found) and any("deviceclass" in p for p in found)


def test_elastic_worker_counts():
    plan = _plan(launcher="ray", ray={"min_slices": 1, "head_node_selector": {"cloud.google.com/gke-nodepool": "cpu"}})
    job = ray.render_rayjob(plan, plan.stages[0], pipeline_run_id="r")
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (2, 1, 2)
    options, _ = ray_driver.parse_args(shlex.split(job["spec"]["entrypoint"])[3:])
    assert ray_driver.worker_counts(options) == (4, 8)
    fixed, _ = ray_driver.parse_args(["--slices=2", "--hosts-per-slice=4", "--chips-per-host=4",
                                      "--storage-path=x", "--name=n"])  # fmt: skip
    assert ray_driver.worker_counts(fixed) == 8


def test_local_ray_stage_is_one_driver_pod_with_the_cpu_arguments():
    plan = _plan("local", launcher="ray")
    stage = plan.stages[1]
    js = launchers.kind_of(stage).render(plan, stage, "cpu", "r")
    assert manifests.object_problems(js) == []
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 1 and rjob["template"]["spec"]["parallelism"] == 1
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 0  # Ray Train retries, not the JobSet
    container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]
    # the pod: a Ray head and the Jobs API submitter (KubeRay's part), whose entrypoint is the driver, as on GKE
    assert container["command"] == ["python", "-m", jobset.LOCAL_RAYJOB_MODULE]
    pod_options, entrypoint = ray_job.parse_args(container["args"])
    assert pod_options.name == stage.workload and pod_options.num_cpus == 2 * plan.slice.hosts + 1
    assert entrypoint == ray.driver_command(plan, stage, "cpu")
    rayjob = ray.render_rayjob(_plan(launcher="ray"), _plan(launcher="ray").stages[1], pipeline_run_id="r")
    assert shlex.split(rayjob["spec"]["entrypoint"])[:3] == entrypoint[:3]  # the same driver module
    assert entrypoint[:3] == ["python", "-m", ray.DRIVER_MODULE]
    options, maxtext_args = ray_driver.parse_args(entrypoint[3:])
    assert not options.tpu and options.slices == 2
    assert {"hardware=cpu", "num_slices=2", "dcn_fsdp_parallelism=2"} <= set(maxtext_args)
    assert [a for a in maxtext_args if a.startswith("jax_cache_dir=")] == [f"jax_cache_dir={plan.jax_cache_dir}"]
    with pytest.raises(ValueError, match="RayJob"):
        jobset.render_ray_driver_jobset(plan, stage, hardware="tpu", pipeline_run_id="r")
    assert launchers.kind_of(stage).render(plan, stage, "tpu", "r")["kind"] == "RayJob"


@pytest.mark.parametrize(("rank", "slice_index", "host"), [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)])
def test_world_rank_to_maxtext_cpu_variables(rank, slice_index, host):
    from multislice.trainer import worker

    env = ray_driver.cpu_env_for_rank(rank, 4, 2)
    assert (int(env["JOB_INDEX"]), int(env["JOB_COMPLETION_INDEX"])) == (slice_index, host)
    assert worker.process_index_from_env(env) == rank  # the JobSet path's numbering


def test_driver_refuses_bad_arguments():
    with pytest.raises(SystemExit):
        ray_driver.parse_args(["--slices=2", "--hosts-per-slice=1", "--chips-per-host=1", "--storage-path=x",
                               "--name=n", "--min-slices=3"])  # fmt: skip
    with pytest.raises(SystemExit):
        ray_driver.parse_args(["--slices=2", "--hosts-per-slice=1", "--chips-per-host=1", "--storage-path=x",
                               "--name=n", "--", "notakeyvalue"])  # fmt: skip


def test_the_gke_backend_renders_a_ray_stage_as_its_rayjob_and_the_default_refuses_it_with_a_fix():
    from types import SimpleNamespace

    from multislice.backends.base import LauncherUnsupported
    from multislice.backends.gke import GkeBackend
    from multislice.timings import DEFAULTS

    plan = _plan(launcher="ray")
    backend = GkeBackend(SimpleNamespace(timings=DEFAULTS["gke"]))  # no cluster needed: rendering makes no call
    manifest = backend.workload_manifest(plan, plan.stages[0], "run-1")
    assert manifest["kind"] == "RayJob" and manifest["metadata"]["name"] == plan.stages[0].jobset
    launcher = backend.launcher_for(plan.stages[0])
    assert list(launcher.claims) == [plan.stages[0].jobset]  # submit creates these first (none without networks)

    class JobSetsOnly(GkeBackend):  # a TPU backend without RayJobs
        launcher_classes = (GkeBackend.launcher_classes[0],)

    with pytest.raises(LauncherUnsupported, match="launcher ray") as refused:
        JobSetsOnly(SimpleNamespace(timings=DEFAULTS["gke"])).workload_manifest(plan, plan.stages[0], "run-1")
    assert "launcher=jobset" in refused.value.fix


def test_the_driver_kill_hook_fires_on_the_leaders_step_line_once(monkeypatch):
    import subprocess

    victim = subprocess.Popen(["sleep", "600"])
    relay = ray_driver._Relay.__new__(ray_driver._Relay)  # no queue, no thread: only the line handling
    relay.kill_rank, relay.kill_after_step, relay.pids, relay.killed = 1, 6, {}, False
    relay._on_line(f"multislice ray worker: rank 1 of 4 (slice 0, host 1) pid {victim.pid}")
    relay._on_line("completed step: 5, seconds: 1.0, loss: 7.0")
    assert victim.poll() is None and not relay.killed
    relay._on_line("completed step: 6, seconds: 1.0, loss: 6.9")
    assert victim.wait(timeout=60) == -9 and relay.killed
    relay._on_line("completed step: 7, seconds: 1.0, loss: 6.8")  # no second kill


def test_the_kill_hook_from_the_environment_applies_to_its_driver_only(monkeypatch):
    base = ["--slices=2", "--hosts-per-slice=2", "--chips-per-host=4", "--storage-path=x"]
    monkeypatch.setenv(ray_driver.KILL_HOOK_ENV, "run-stage-a:1:6")
    options, _ = ray_driver.parse_args([*base, "--name=run-stage-a"])
    assert (options.kill_rank, options.kill_after_step) == (1, 6)
    options, _ = ray_driver.parse_args([*base, "--name=run-stage-b"])
    assert options.kill_rank is None


def test_the_driver_reads_its_submission_id_from_the_jobs_api_job_config(monkeypatch):
    # what Ray's JobSupervisor passes its driver (ray 2.60.0 job_supervisor.py, _get_driver_env_vars)
    config = {"runtime_env": {}, "metadata": {"job_submission_id": "run-stage-ab1c2", "job_name": "run-stage-ab1c2"}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(config))
    assert ray_driver.submission_id() == "run-stage-ab1c2"
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    assert ray_driver.submission_id() is None  # not submitted through the Jobs API


def test_each_submission_id_is_the_name_and_five_characters_as_kuberays():
    ids = {ray_job.submission_id("run-stage") for _ in range(20)}
    assert len(ids) > 1
    for job_id in ids:
        prefix, suffix = job_id.rsplit("-", 1)
        assert prefix == "run-stage" and len(suffix) == 5 and set(suffix) <= set("abcdefghijklmnopqrstuvwxyz0123456789")
