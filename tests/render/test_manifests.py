"""Rendered manifests: valid against the upstream CRDs, shaped as GKE multislice needs, equal to goldens."""

import filecmp
import json

import pytest
import yaml
from google.cloud.container_v1 import NodePool

from multislice import config
from multislice.backends import manifests as run_manifests
from multislice.plan import make_plan
from multislice.render import jobset, kueue, manifests, schema
from tests.conftest import SHARED_CRDS
from tests.golden import MANIFEST_VARIANTS, PROFILES, golden_files, rendered_manifests

CRD_DIRS = [schema.CRDS_DIR] + ([SHARED_CRDS] if SHARED_CRDS.is_dir() else [])


def all_objects(profile):
    plan = make_plan(config.load_profile(profile))
    objects = kueue.render_kueue_objects(plan)
    for stage in plan.stages:
        objects += [jobset.render_jobset(plan, stage, hardware=f, pipeline_run_id="run-1") for f in ("tpu", "cpu")]
    return objects


def test_vendored_crds_are_the_shared_upstream_copies():
    if not SHARED_CRDS.is_dir():
        pytest.skip(f"{SHARED_CRDS} is not on this machine; the vendored copy is used alone")
    for path in SHARED_CRDS.rglob("*.yaml"):
        assert filecmp.cmp(path, schema.CRDS_DIR / path.relative_to(SHARED_CRDS), shallow=False), path


@pytest.mark.parametrize("crds_dir", CRD_DIRS, ids=lambda p: p.parent.name)
@pytest.mark.parametrize("profile", PROFILES)
def test_every_rendered_object_validates(profile, crds_dir):
    index = schema.crd_index(crds_dir)
    for obj in all_objects(profile):
        assert (obj["apiVersion"], obj["kind"]) in index
        assert schema.problems(obj, crds_dir) == [], obj["metadata"]["name"]
        report = schema.check_cel(obj, crds_dir)
        assert report.problems == []


def test_cel_rules_are_evaluated_not_skipped():
    cluster_queue = next(o for o in all_objects("gke-v6e-16x2-seed") if o["kind"] == "ClusterQueue")
    report = schema.check_cel(cluster_queue)
    assert any("coveredResources" in rule for rule in report.evaluated)


def test_validation_catches_typos_wrong_types_and_cel_violations():
    objects = all_objects("gke-v6e-16x2-seed")
    js = next(o for o in objects if o["kind"] == "JobSet")
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["nodeSelctor"] = pod.pop("nodeSelector")
    js["spec"]["replicatedJobs"][0]["replicas"] = "two"
    found = schema.problems(js)
    assert any("nodeSelctor" in p for p in found) and any("'two' is not of type 'integer'" in p for p in found)
    cluster_queue = next(o for o in objects if o["kind"] == "ClusterQueue")
    cluster_queue["spec"]["resourceGroups"][0]["coveredResources"].append("cpu")
    assert schema.problems(cluster_queue) == [
        "spec.resourceGroups[0]: flavors must have the same number of resources as the coveredResources"
    ]
    flavor = objects[0]
    flavor["metadata"]["labels"]["bad key!"] = "x"
    flavor["metadata"]["namespace"] = "default"
    found = schema.problems(flavor)
    assert any("bad key!" in p for p in found) and any("cluster-scoped" in p for p in found)
    with pytest.raises(schema.ManifestInvalid, match="ResourceFlavor"):
        schema.validate(flavor)


def test_tpu_jobset_is_a_gke_multislice_jobset():
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed"))
    # Recreate: what provision falls back to; the in-place parts are tests/render/test_in_place.py's
    obj = jobset.render_jobset(
        plan, plan.stages[1], hardware="tpu", pipeline_run_id="run-7", restart_strategy="Recreate"
    )
    meta = obj["metadata"]
    assert meta["annotations"] == {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    assert meta["labels"]["kueue.x-k8s.io/queue-name"] == "multislice-queue"
    assert meta["labels"]["kueue.x-k8s.io/priority-class"] == "default-priority"
    assert meta["labels"]["pipeline/runid"] == "run-7"
    [rj] = obj["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert rj["replicas"] == 2 and job["parallelism"] == job["completions"] == 4 and job["backoffLimit"] == 0
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    [container] = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": 4}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert isinstance(container["args"], list) and "model_name=llama3-70b" in container["args"]
    policy = obj["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 4 and all(rule["name"] for rule in policy["rules"])
    # GKE's webhook injects TPU_WORKER_* and MEGASCALE_*; we set only libtpu's flags (multislice.libtpu_flags)
    # and unbuffered output (issue 29).
    assert [e["name"] for e in container["env"]] == ["LIBTPU_INIT_ARGS", "PYTHONUNBUFFERED"]


def test_v6e_8_on_one_vm_renders_one_pod_of_8_chips_per_slice():
    plan = make_plan(
        config.load_profile(
            "gke-v6e-16x2-seed",
            {
                "tpu_type": "v6e-8",
                "machine_type": "ct6e-standard-8t",
                "stages.0.ici": {"fsdp": 8, "tensor": 1},
                "stages.1.ici": {"tensor": 8, "fsdp": 1},
            },
        )
    )
    obj = jobset.render_jobset(plan, plan.stages[0], hardware="tpu", pipeline_run_id="run-7")
    [rj] = obj["spec"]["replicatedJobs"]
    job = rj["template"]["spec"]
    assert rj["replicas"] == 2 and job["parallelism"] == job["completions"] == 1
    pod = job["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    [container] = pod["containers"]
    assert container["resources"]["limits"] == {"google.com/tpu": 8}
    assert run_manifests.render_all(plan, "run-7")  # every object validated as the plan step validates it


def test_cpu_jobset_passes_maxtext_cpu_environment():
    plan = make_plan(config.load_profile("local"))
    obj = jobset.render_jobset(plan, plan.stages[0], hardware="cpu", pipeline_run_id="r")
    assert "annotations" not in obj["metadata"]
    pod = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert (
        env["JOB_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    )
    assert (
        env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert env["PROCESSES_IN_JOB"]["value"] == "2" and env["JAX_PROCESS_COUNT"]["value"] == "4"
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == "$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-0-0.$(JOBSET_NAME)"
    assert "nodeSelector" not in pod and "resources" not in pod["containers"][0]


def _containers(obj):
    """Every container of an object's pod templates, wherever the kind nests them (JobSet, RayJob, Job)."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from value if key == "containers" else _containers(value)
    elif isinstance(obj, list):
        for item in obj:
            yield from _containers(item)


def test_every_trainer_image_container_runs_python_unbuffered():
    """Issue 29: a pod's stdout is a pipe, so without ``PYTHONUNBUFFERED=1`` prints (a remote function's, MaxText's
    step lines) reach the log in 8 KiB blocks. Every rendered container of the trainer image carries it: each file
    ``multislice render`` writes (TPU and CPU JobSets, the RayJob's head and workers, the export Job) and the Jobs
    the GKE backend renders at run time (verifier, AOT compile), each valid as the API server would check it."""
    from multislice.backends.gke import aot, verifier
    from multislice.preflight import request_for
    from tests.golden import rendered_manifests

    unbuffered = {"name": "PYTHONUNBUFFERED", "value": "1"}
    seen: dict[str, int] = {}
    objects = []
    for profile in (*PROFILES, *MANIFEST_VARIANTS):
        for name, text in rendered_manifests(profile).items():
            if name.endswith(".yaml") and "/" not in name:  # kueue-config/, gke-api/: not API objects
                kind = name.split("-", 1)[0] + ("." + name.split(".")[-2] if name.startswith("jobset-") else "")
                objects.append((kind, yaml.safe_load(text)))
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed"))
    objects.append(("job-verify", verifier.render_job(plan, plan.stages[1], "run-1")))
    objects.append(("job-aot", aot.render_job(plan, request_for(plan, plan.stages[1]), None, "run-1")))
    for kind, obj in objects:
        assert manifests.object_problems(obj) == [], obj["metadata"]["name"]
        for container in _containers(obj):
            if container["image"] != plan.spec.images.trainer:
                continue  # the reaper CronJob runs the pipeline image
            assert unbuffered in container.get("env", []), (obj["metadata"]["name"], container["name"])
            seen[f"{kind}/{container['name']}"] = seen.get(f"{kind}/{container['name']}", 0) + 1
    assert set(seen) == {
        "jobset.tpu/maxtext", "jobset.cpu/maxtext", "rayjob/ray-head", "rayjob/ray-worker",
        "job/maxtext", "job-verify/maxtext", "job-aot/maxtext",
    }  # fmt: skip


def test_cluster_queue_quota_is_slices_times_chips():
    plan = make_plan(
        config.load_profile("gke-v6e-16x2-seed", {"num_slices": 4, "stages.1.dcn": {"fsdp": 4, "data": 1}})
    )
    flavor, cpu_flavor, cluster_queue, priority, local_queue = kueue.render_kueue_objects(plan)
    group, cpu_group = cluster_queue["spec"]["resourceGroups"]
    assert group["flavors"][0]["resources"] == [{"name": "google.com/tpu", "nominalQuota": 64}]
    # the run form offers launcher=ray: its RayJob's head and submitter on a CPU flavor with no node labels
    assert cpu_group["flavors"][0]["name"] == cpu_flavor["metadata"]["name"] == kueue.CPU_FLAVOR
    assert cpu_group["coveredResources"] == ["cpu", "memory"] and "spec" not in cpu_flavor
    assert group["flavors"][0]["name"] == flavor["metadata"]["name"] == "v6e-4x4"
    assert local_queue["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"]
    assert priority["value"] == 100


def test_a_ray_run_with_dranet_writes_the_kueue_configuration_fragment_it_needs():
    from tests.golden import rendered_manifests

    files = rendered_manifests("gke-v6e-16x2-seed-ray")
    fragment = yaml.safe_load(files["kueue-config/controller_manager_config.yaml"])
    assert fragment == {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "resources": {"deviceClassMappings": [
            {"name": "multislice-pipelines/netdev", "deviceClassNames": ["netdev.google.com"]}]},
    }  # fmt: skip
    assert "kueue-manager-config" in files["kueue-config/controller_manager_config.yaml"]  # where it goes
    assert not any(name.startswith("kueue-config/") for name in rendered_manifests("gke-v6e-16x2-seed"))


def test_bad_pipeline_run_id_is_refused():
    plan = make_plan(config.load_profile("local"))
    with pytest.raises(ValueError, match="label value"):
        jobset.render_jobset(plan, plan.stages[0], hardware="cpu", pipeline_run_id="not a label!")


@pytest.mark.parametrize("profile", [*PROFILES, *MANIFEST_VARIANTS])
def test_manifests_match_golden_files(profile):
    rendered = rendered_manifests(profile)
    stored = golden_files(profile)
    assert sorted(rendered) == sorted(stored), "run `make goldens`"
    for name, text in rendered.items():
        assert text == stored[name].read_text(encoding="utf-8"), f"{profile}/{name} changed: run `make goldens`"


def test_render_cli_writes_every_manifest_validated(tmp_path):
    from multislice import cli

    assert cli.main(["render", "--profile", "gke-v6e-16x2-seed", "--output", str(tmp_path)]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(rendered_manifests("gke-v6e-16x2-seed"))
    kinds = set()
    for path in tmp_path.glob("*.yaml"):
        obj = yaml.safe_load(path.read_text())
        kinds.add(obj["kind"])
        if (obj["apiVersion"], obj["kind"]) in schema.BUILTIN_KINDS:
            assert manifests.object_problems(obj) == [], path.name
        else:
            for crds_dir in CRD_DIRS:
                assert schema.problems(obj, crds_dir) == [], (path.name, crds_dir)
    assert kinds == {
        "JobSet", "ResourceFlavor", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass",
        "ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "CronJob", "Job",
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",  # the in-place restart agent's limit
    }  # fmt: skip
    # The node pool plan: the GKE API request provision sends for each slice, not a Kubernetes object.
    node_pools = json.loads((tmp_path / run_manifests.NODE_POOL_PLAN).read_text())
    assert node_pools["cluster"] == "projects/your-project/locations/us-east5/clusters/your-cluster"
    assert [p["name"] for p in node_pools["node_pools"]] == ["tpu-v6e-4x4-0", "tpu-v6e-4x4-1"]
    request = node_pools["node_pools"][0]["request"]
    assert request["method"] == "POST"
    assert request["uri"] == (
        "https://container.googleapis.com/v1/projects/your-project/locations/us-east5/clusters/your-cluster/nodePools"
    )
    # Every field is a real NodePool field of the GKE API (the client's own parser rejects unknown ones).
    for pool in node_pools["node_pools"]:
        NodePool.from_json(json.dumps(pool["request"]["body"]["nodePool"]), ignore_unknown_fields=False)
    with pytest.raises(Exception, match="tpuTopologgy"):
        NodePool.from_json(json.dumps({"placementPolicy": {"tpuTopologgy": "4x4"}}), ignore_unknown_fields=False)
    assert request["body"]["nodePool"] == {
        "name": "tpu-v6e-4x4-0",
        "config": {
            "machineType": "ct6e-standard-4t",
            "oauthScopes": ["https://www.googleapis.com/auth/cloud-platform"],
        },
        "initialNodeCount": 4,
        "locations": ["us-east5-b"],
        "placementPolicy": {"type": "COMPACT", "tpuTopology": "4x4"},
    }


def test_local_profile_renders_no_gke_objects():
    assert not any(name.startswith(("rbac-", "gke-api/")) for name in rendered_manifests("local"))


def test_finished_tpu_jobsets_have_a_ttl_from_the_profile():
    def ttl(**overrides):
        plan = make_plan(config.load_profile("gke-v6e-16x2-seed", overrides))
        rendered = jobset.render_jobset(plan, plan.stages[0], hardware="tpu", pipeline_run_id="r")
        schema.validate(rendered)  # spec.ttlSecondsAfterFinished is a JobSet v0.12.0 field
        return rendered["spec"].get("ttlSecondsAfterFinished")

    assert ttl() == 43200  # xpk's
    assert ttl(jobset_ttl_seconds=600) == 600
    assert ttl(jobset_ttl_seconds=None) is None


def test_gke_render_carries_the_reaper_cronjob_checked_as_the_api_server_would():
    """The cancel safety net is part of what ``multislice render`` writes, and a broken CronJob is refused."""
    import copy

    from multislice import config
    from multislice.backends import manifests
    from multislice.plan import make_plan

    plan = make_plan(config.load_profile("gke-v6e-16x2-seed"))
    reaper = manifests.render_all(plan, "run-1")["cronjob-multislice-reaper.yaml"]
    container = reaper["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["multislice", "reap"] and container["image"] == plan.spec.images.pipeline
    assert reaper["spec"]["jobTemplate"]["spec"]["template"]["spec"]["serviceAccountName"] == "multislice-pipeline"
    broken = copy.deepcopy(reaper)
    del broken["spec"]["schedule"]
    assert manifests.object_problems(broken) == ["spec: Invalid value for `schedule`, must not be `None`"]
    broken = copy.deepcopy(reaper)
    broken["spec"]["schedul"] = "* * * * *"
    assert "unknown fields ['schedul']" in manifests.object_problems(broken)[0]


def test_the_reaper_cronjob_acts_on_the_rendered_cluster_as_a_service_account_of_its_own_namespace():
    """The CronJob's command names the cluster and namespace the profile resolved to (not a packaged placeholder
    profile's ``your-project/your-cluster``), and it runs in the namespace where its ServiceAccount is rendered
    (``pipeline_namespace``: a pod can only use a ServiceAccount of its own namespace). The command, parsed by the
    CLI, reaches that cluster (``multislice reap``'s own argument parsing, no profile read in the pod)."""
    from multislice import config
    from multislice.backends import manifests
    from multislice.cli import app, reap
    from multislice.plan import make_plan

    overrides = {"cluster.project": "real-proj", "cluster.location": "europe-west4", "cluster.name": "tpu-prod",
                 "node_pools.zone": "europe-west4-a",
                 "namespace": "team-a", "service_accounts.pipeline_namespace": "kubeflow"}  # fmt: skip
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed", overrides))
    rendered = manifests.render_all(plan, "run-1")
    reaper = rendered["cronjob-multislice-reaper.yaml"]
    pod = reaper["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    accounts = [obj for obj in rendered.values() if obj["kind"] == "ServiceAccount"]
    where = {obj["metadata"]["name"]: obj["metadata"]["namespace"] for obj in accounts}
    assert where[pod["serviceAccountName"]] == reaper["metadata"]["namespace"] == "kubeflow"
    command = pod["containers"][0]["command"]
    assert "--profile" not in command and "your-project" not in command and "your-cluster" not in command
    args = app.build_parser(command[1:]).parse_args(command[1:])
    cluster, namespace = reap.reap_target(args)
    assert (cluster.project, cluster.location, cluster.name, cluster.access) == (
        "real-proj", "europe-west4", "tpu-prod", "in-cluster")  # fmt: skip
    assert namespace == "team-a"  # the runs' namespace, where the Role grants the reaper its rights
    role_binding = rendered["rbac-rolebinding-multislice-pipeline.yaml"]
    assert role_binding["metadata"]["namespace"] == "team-a"
    assert {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": "kubeflow"} in (
        role_binding["subjects"])  # fmt: skip


def test_multislice_reap_without_a_profile_refuses_a_missing_namespace_and_bad_names(capsys):
    from multislice.cli import app

    assert app.main(["reap", "--in-cluster", "--project", "Bad_Project"]) == 2
    err = capsys.readouterr().err
    assert "--namespace" in err and "--project" in err and "Traceback" not in err


def test_the_export_job_is_checked_as_the_api_server_would():
    """Each stage's export Job (``job-<stage>-export.yaml``): a misspelt field, a bad quantity or a limit below its
    request is refused by ``object_problems``, as the API server refuses them."""
    import copy

    from multislice import config
    from multislice.backends.gke import exporter
    from multislice.plan import make_plan

    plan = make_plan(config.load_profile("gke-v6e-16x2-seed"))
    job = exporter.render_job(plan, plan.stages[1], "run-1")
    assert manifests.object_problems(job) == []
    bad = copy.deepcopy(job)
    container = bad["spec"]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")
    container["resources"]["requests"]["cpu"] = "eight"
    container["resources"]["limits"]["memory"] = "1Gi"
    found = "\n".join(manifests.object_problems(bad))
    assert "unknown fields ['volumeMount']" in found
    assert "resources.requests.cpu: 'eight' is not a quantity" in found
    assert "memory limit below its request" in found


def test_goodput_recording_renders_maxtexts_recorder_with_this_runs_job_name_and_is_off_by_default():
    """``goodput_recording`` turns on MaxText's Cloud Logging recorder (``enable_goodput_recording``) under a job
    name of this run's (MaxText's default, ``run_name``, is the stage's name in every run); off unless asked."""
    plain = make_plan(config.load_profile("gke-v6e-16x2-seed"))
    [container] = jobset.render_jobset(plain, plain.stages[0], hardware="tpu", pipeline_run_id="r")["spec"][
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]  # fmt: skip
    assert not [a for a in container["args"] if "goodput" in a]
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed", {"stages.0.goodput_recording": True}))
    obj = jobset.render_jobset(plan, plan.stages[0], hardware="tpu", pipeline_run_id="r")
    schema.validate(obj)
    [container] = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert "enable_goodput_recording=true" in container["args"]
    assert "goodput_job_name=llama3-multislice-llama3-8b" in container["args"]
    # The hostNetwork TPU pods write as the nodes' service account: it gets Cloud Logging's writer role.
    from multislice.backends.gke.nodepool import DEFAULT_NODE_ACCOUNT, iam_bindings

    writer = f"--member=serviceAccount:{DEFAULT_NODE_ACCOUNT} --role=roles/logging.logWriter"
    assert [line for line in iam_bindings(plan) if "logging" in line] == [
        f"gcloud projects add-iam-policy-binding your-project {writer}"
    ]
    assert not [line for line in iam_bindings(plain) if "logging" in line]


def test_goodput_recording_is_refused_on_the_local_backend():
    with pytest.raises(config.ConfigError, match=r"stages\[0\] \(tiny-8b-recipe\).goodput_recording: .*Cloud Logging"):
        config.load_profile("local", {"stages.0.goodput_recording": True})
