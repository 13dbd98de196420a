"""Kueue's admission of the rendered workloads, in the emulator's Kueue model (tests/kueue_model.py).

The model computes what Kueue v0.19.2 computes (pod sets, requests, DRA devices, flavor assignment against the
ClusterQueue's nominal quota) from what the emulated cluster stores, and leaves a Workload it cannot admit pending
with Kueue's condition. These scenarios check that the queue, flavors and Kueue Configuration ``multislice render``
writes admit the RayJob, that the queue as rendered before the CPU resource group (TPU only) and Kueue's shipped
Configuration (no DRANET mapping) do not, and what admit and provision then say.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from kubernetes import client as k8s

from multislice import cli, config, tpu
from multislice.backends.base import AdmissionBlocked
from multislice.backends.gke import GkeBackend
from multislice.backends.gke import cluster as gke_cluster
from multislice.plan import make_plan
from multislice.render import jobset as render_jobset
from multislice.render import kueue, rbac
from multislice.render import ray as render_ray
from multislice.steps import admit, provision
from tests import kueue_model
from tests.backends.gke.harness import POOLS, RUN_ID, Background, stage_of
from tests.backends.gke.test_prerequisites import TPU_WEBHOOK
from tests.backends.gke.test_ray import OVERRIDES
from tests.kube_controllers import KubeRay
from tests.kube_rbac import service_account_user

pytestmark = pytest.mark.usefixtures("run_storage", "node_pools")

KUEUE_API = ("kueue.x-k8s.io", "v1beta2")


@pytest.fixture
def plan():
    """Every stage launched by Ray, with DRANET claims (test_ray.py's plan)."""
    return make_plan(config.load_profile("gke-v6e-16x2-seed", OVERRIDES))


@pytest.fixture(autouse=True)
def least_privilege(served, plan):
    accounts = plan.spec.service_accounts
    served.as_user(service_account_user(plan.spec.namespace, accounts.pipeline), rbac.render_rbac_objects(plan))


def todays_queue(plan) -> dict:
    """The ClusterQueue as multislice/render/kueue.py rendered it before the CPU resource group (commit d4c7dad):
    one resource group covering google.com/tpu only."""
    queue = next(o for o in kueue.render_kueue_objects(plan) if o["kind"] == "ClusterQueue")
    queue = copy.deepcopy(queue)
    queue["spec"]["resourceGroups"] = [{"coveredResources": [tpu.TPU_RESOURCE], "flavors": [
        {"name": plan.spec.slice_type.flavor_name,
         "resources": [{"name": tpu.TPU_RESOURCE, "nominalQuota": plan.total_chips}]}]}]  # fmt: skip
    return queue


def replace_queue(play, queue: dict) -> None:
    """The ClusterQueue replaced by ``queue`` (deleted and created: kmock serves no PUT)."""
    play.custom.delete_cluster_custom_object(*KUEUE_API, "clusterqueues", queue["metadata"]["name"])
    play.custom.create_cluster_custom_object(*KUEUE_API, "clusterqueues", queue)


def queued(play, plan) -> KubeRay:
    """The stage's claim templates and RayJob created (as admit creates them), queued by Kueue's RayJob integration."""
    stage = stage_of(plan)
    for template in render_ray.render_claim_templates(plan, stage, pipeline_run_id=RUN_ID):
        play.custom.create_namespaced_custom_object("resource.k8s.io", "v1", "default", "resourceclaimtemplates",
                                                    template)  # fmt: skip
    rayjob = render_ray.render_rayjob(plan, stage, pipeline_run_id=RUN_ID)
    play.custom.create_namespaced_custom_object("ray.io", "v1", "default", "rayjobs", rayjob)
    ray = KubeRay(play, stage.jobset, plan.spec.num_slices, plan.slice.hosts, POOLS)
    ray.kueue_queues("waiting")
    return ray


def admit_refused(play, plan, kube) -> tuple[AdmissionBlocked, str | None]:
    """admit with Kueue's RayJob integration queueing the RayJob and the model deciding: (admit's error, the pending
    message the model wrote)."""
    ray = KubeRay(play, stage_of(plan).jobset, plan.spec.num_slices, plan.slice.hosts, POOLS)
    said: list[str | None] = []

    def scheduler():
        ray.kueue_queues("waiting")
        said.append(ray.kueue_admits())

    with Background(scheduler), pytest.raises(AdmissionBlocked) as refused:
        admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(kube))
    return refused.value, said[0]


# -- pod sets and requests -------------------------------------------------------------------------------------------


def test_the_rayjobs_pod_sets_are_its_head_its_slices_and_kueues_default_submitter(plan):
    rayjob = render_ray.render_rayjob(plan, stage_of(plan), pipeline_run_id=RUN_ID)
    sets = kueue_model.pod_sets(rayjob)
    assert [(s["name"], s["count"]) for s in sets] == [("head", 1), ("slice", 8), ("submitter", 1)]
    requests = [kueue_model.pod_requests(s["template"]["spec"]) for s in sets]
    assert requests == [{"cpu": 4000, "memory": 16 * 2**30}, {tpu.TPU_RESOURCE: 4}, {"cpu": 500, "memory": 200 * 2**20}]
    # The renderer's own derivation (multislice.render.kueue.pod_sets) agrees with the model's.
    rendered = kueue.pod_sets(rayjob)
    assert [(s.name, s.count) for s in rendered] == [(s["name"], s["count"]) for s in sets]
    assert [{n: int(v * 1000) if n == "cpu" else int(v) for n, v in s.requests.items()} for s in rendered] == requests


def test_a_jobsets_pods_request_only_tpu_chips_and_its_queue_covers_ray_from_the_run_form():
    """The JobSet path: one pod set per replicated job (replicas x parallelism pods), TPU chips only (limits as
    requests); so the queue of a JobSet-only plan keeps its one resource group."""
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed"))
    js = render_jobset.render_jobset(plan, stage_of(plan), hardware="tpu", pipeline_run_id=RUN_ID)
    sets = kueue_model.pod_sets(js)
    assert [(s["name"], s["count"]) for s in sets] == [("slice", 8)]
    assert kueue_model.pod_requests(sets[0]["template"]["spec"]) == {tpu.TPU_RESOURCE: 4}
    assert set(kueue.stage_usage(plan, offered=False)) == {tpu.TPU_RESOURCE}
    # The run form offers launcher=ray, so the rendered queue still covers a RayJob's head and submitter, as RBAC
    # covers its RayJob: picking ray in the run form is admitted, not left pending on "resource memory unavailable".
    assert kueue.cpu_flavor_needed(plan)
    assert [g["coveredResources"] for g in kueue.resource_groups(plan)] == [[tpu.TPU_RESOURCE], ["cpu", "memory"]]


def test_pod_requests_count_sidecars_init_containers_and_overhead_as_kubernetes_does():
    pod = {
        "initContainers": [
            {"name": "setup", "resources": {"requests": {"cpu": "2"}}},
            {"name": "proxy", "restartPolicy": "Always", "resources": {"limits": {"cpu": "250m", "memory": "64Mi"}}},
            {"name": "late", "resources": {"requests": {"cpu": "1"}}},
        ],
        "containers": [{"name": "main", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}}],
        "overhead": {"cpu": "100m"},
    }
    # containers 1 + sidecar 0.25 = 1.25; init peak max(2, 0.25 + 1) = 2 -> 2, plus overhead 0.1
    assert kueue_model.pod_requests(pod) == {"cpu": 2100, "memory": 2**30 + 64 * 2**20}
    assert kueue.pod_requests(pod) == {"cpu": kueue.quantity("2100m"), "memory": kueue.quantity("1088Mi")}


def test_kueues_resource_order_and_quantity_texts():
    assert kueue_model.fnv1a64("a") == 0xAF63DC4C8601EC8C  # the FNV-1a 64 test vector
    assert kueue_model.ordered(["cpu", "memory", tpu.TPU_RESOURCE]) == ["memory", tpu.TPU_RESOURCE, "cpu"]
    texts = [
        kueue_model.quantity_text("cpu", 4500),
        kueue_model.quantity_text("cpu", 4000),
        kueue_model.quantity_text("memory", 16584 * 2**20),
        kueue_model.quantity_text(tpu.TPU_RESOURCE, 32),
    ]
    assert texts == ["4500m", "4", "16584Mi", "32"]  # fmt: skip


# -- the rendered queue ----------------------------------------------------------------------------------------------


def test_the_rendered_queue_covers_the_rayjobs_head_submitter_and_dranet_devices(plan):
    groups = kueue.resource_groups(plan)
    assert groups == [
        {"coveredResources": [tpu.TPU_RESOURCE, kueue.DRANET_RESOURCE], "flavors": [{"name": "v6e-4x4", "resources": [
            {"name": tpu.TPU_RESOURCE, "nominalQuota": 32}, {"name": kueue.DRANET_RESOURCE, "nominalQuota": 8}]}]},
        {"coveredResources": ["cpu", "memory"], "flavors": [{"name": kueue.CPU_FLAVOR, "resources": [
            {"name": "cpu", "nominalQuota": "4500m"}, {"name": "memory", "nominalQuota": "16584Mi"}]}]},
    ]  # fmt: skip
    flavor = next(o for o in kueue.render_kueue_objects(plan) if o["metadata"]["name"] == kueue.CPU_FLAVOR)
    assert "spec" not in flavor  # no node labels: any node, no node selector added on admission


def test_the_rendered_queue_admits_the_rayjob_with_a_flavor_per_resource_group(served, play, plan, told):
    kube = served.kube()
    ray = KubeRay(play, stage_of(plan).jobset, plan.spec.num_slices, plan.slice.hosts, POOLS)
    admitted: list[str | None] = []

    def scheduler():
        ray.kueue_queues("waiting")
        admitted.append(ray.kueue_admits())

    with Background(scheduler, told):
        report = admit.run(plan, stage_of(plan), RUN_ID, backend=GkeBackend(kube))
    assert admitted == [None] and report.admitted
    assert report.flavors == [kueue.CPU_FLAVOR, "v6e-4x4"]  # the head's (first pod set) first
    stored = play.custom.get_namespaced_custom_object(*KUEUE_API, "default", "workloads", ray.workload)
    assignments = {a["name"]: a for a in stored["status"]["admission"]["podSetAssignments"]}
    assert assignments["head"]["flavors"] == {"memory": kueue.CPU_FLAVOR, "cpu": kueue.CPU_FLAVOR}
    assert assignments["head"]["resourceUsage"] == {"memory": "16Gi", "cpu": "4"}
    assert assignments["slice"]["flavors"] == {kueue.DRANET_RESOURCE: "v6e-4x4", tpu.TPU_RESOURCE: "v6e-4x4"}
    assert assignments["slice"]["resourceUsage"] == {kueue.DRANET_RESOURCE: "8", tpu.TPU_RESOURCE: "32"}
    assert assignments["submitter"]["resourceUsage"] == {"memory": "200Mi", "cpu": "500m"}


def test_todays_tpu_only_queue_leaves_the_rayjob_pending_and_admit_names_the_missing_resource(served, play, plan):
    """The queue rendered before this change (TPU only): Kueue cannot place the head's memory and cpu."""
    replace_queue(play, todays_queue(plan))
    refused, said = admit_refused(play, plan, served.kube())
    # memory before cpu: Kueue's SliceRequests order (FNV-1a of the names), the first uncovered one is reported
    expected = "couldn't assign flavors to pod set head: resource memory unavailable in ClusterQueue"
    assert said == expected
    assert f"QuotaReserved False: Pending: {expected}" in refused.message
    assert "a pod set requests memory and no resource group of the ClusterQueue covers it" in refused.fix
    assert "--set launcher=ray" in refused.fix and kueue.CPU_FLAVOR in refused.fix


def test_a_queue_too_small_for_the_submitter_says_kueues_insufficient_quota(play, plan):
    queue = copy.deepcopy(next(o for o in kueue.render_kueue_objects(plan) if o["kind"] == "ClusterQueue"))
    queue["spec"]["resourceGroups"][1]["flavors"][0]["resources"][0]["nominalQuota"] = "4"  # the head's cpu only
    replace_queue(play, queue)
    assert queued(play, plan).kueue_admits() == (
        "couldn't assign flavors to pod set submitter: insufficient quota for cpu in flavor multislice-cpu, previously "
        "considered podsets requests (4) + current podset request (500m) > maximum capacity (4)"
    )


def test_another_workload_holding_the_slices_leaves_the_rayjob_waiting_for_unused_quota(play, plan):
    group, version = KUEUE_API
    other = {"apiVersion": f"{group}/{version}", "kind": "Workload",
             "metadata": {"name": "someone-else", "namespace": "default"},
             "spec": {"queueName": plan.spec.queue, "podSets": []}}  # fmt: skip
    play.custom.create_namespaced_custom_object(group, version, "default", "workloads", other)
    held = {"conditions": [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "x"}],
            "admission": {"clusterQueue": plan.spec.cluster_queue, "podSetAssignments": [
                {"name": "slice", "count": 4, "flavors": {tpu.TPU_RESOURCE: "v6e-4x4"},
                 "resourceUsage": {tpu.TPU_RESOURCE: "16"}}]}}  # fmt: skip
    play.custom.patch_namespaced_custom_object_status(group, version, "default", "workloads", "someone-else",
                                                      {"status": held})  # fmt: skip
    assert queued(play, plan).kueue_admits() == (
        "couldn't assign flavors to pod set slice: insufficient unused quota for google.com/tpu in flavor v6e-4x4, "
        "16 more needed"
    )


# -- DRANET under Kueue ----------------------------------------------------------------------------------------------


def test_an_unmapped_dranet_device_class_is_inadmissible_and_admit_names_the_fix(served, play, plan):
    """Kueue's shipped Configuration (no deviceClassMappings), as on a cluster set up from today's render."""
    play.kueue_configuration(kueue_model.DEFAULT_CONFIGURATION)
    refused, said = admit_refused(play, plan, served.kube())
    expected = ('spec.podSets[1].template.spec.resourceClaims[0].resourceClaimTemplateName: Not found: "DeviceClass '
                'netdev.google.com is not mapped in DRA configuration for podset slice"')  # fmt: skip
    assert said == expected
    assert f"QuotaReserved False: Inadmissible: {expected}" in refused.message
    assert "kueue-config/controller_manager_config.yaml" in refused.fix
    assert "kueue-system/kueue-manager-config" in refused.fix and kueue.DRANET_RESOURCE in refused.fix


def test_kueues_dra_integration_turned_off_rejects_the_rayjob(served, play, plan):
    configuration = {**kueue.kueue_configuration(plan), "featureGates": {"KueueDRAIntegration": False}}
    play.kueue_configuration({**kueue_model.DEFAULT_CONFIGURATION, **configuration})
    refused, said = admit_refused(play, plan, served.kube())
    assert said == "Workload uses DRA resources but the KueueDRAIntegration feature gate is not enabled"
    assert "enable Kueue's KueueDRAIntegration feature gate" in refused.fix


def test_provision_fails_before_any_node_pool_when_kueue_does_not_map_dranet(served, play, plan, node_pools):
    play.kueue_configuration(kueue_model.DEFAULT_CONFIGURATION)
    with pytest.raises(gke_cluster.KueueMisconfigured) as refused:
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert "maps no resource to DeviceClass netdev.google.com" in refused.value.message
    assert "merge kueue-config/controller_manager_config.yaml" in refused.value.fix
    assert node_pools == []  # nothing was created

    play.kueue_configuration({**kueue_model.DEFAULT_CONFIGURATION, "resources": {"deviceClassMappings": [
        {"name": "example.com/nic", "deviceClassNames": ["netdev.google.com"]}]}})  # fmt: skip
    with pytest.raises(gke_cluster.KueueMisconfigured, match="maps DeviceClass netdev.google.com to example.com/nic"):
        provision.run(plan, backend=GkeBackend(served.kube()))


def test_provision_passes_with_the_rendered_kueue_configuration_merged(served, play, plan, node_pools, capsys):
    """The ``play`` fixture merged ``multislice render``'s kueue-config fragment into Kueue's ConfigMap; the
    pipeline reads it under the rendered RBAC (a Role in kueue-system for that ConfigMap only). The KubeRay TPU
    webhook is installed (provision checks it for a Ray run, :mod:`tests.backends.gke.test_prerequisites`)."""
    k8s.AdmissionregistrationV1Api(served.api(admin=True)).create_mutating_webhook_configuration(TPU_WEBHOOK)
    provision.run(plan, backend=GkeBackend(served.kube()))
    assert "Kueue maps DeviceClass netdev.google.com to multislice-pipelines/netdev" in capsys.readouterr().out
    assert node_pools == ["r1"]


def test_multislice_render_with_launcher_ray_writes_a_queue_that_admits_its_rayjob(bare_play, tmp_path):
    """``multislice render --profile gke-v6e-16x2-seed --set launcher=ray`` (every file validated against the CRDs): its
    Kueue objects applied as written, its RayJob created from its file, and Kueue's model admits it."""
    code = cli.main(["render", "--profile", "gke-v6e-16x2-seed", "--set", "launcher=ray", "--output", str(tmp_path)])
    assert code == 0
    assert not (tmp_path / "kueue-config").exists()  # no DRANET: nothing for Kueue's Configuration
    read = lambda path: yaml.safe_load(path.read_text(encoding="utf-8"))  # noqa: E731
    bare_play.install_kueue([read(path) for path in sorted(tmp_path.glob("kueue-*.yaml"))])
    for path in sorted(tmp_path.glob("rayjob-*.tpu.yaml")):
        rayjob = read(path)
        bare_play.custom.create_namespaced_custom_object("ray.io", "v1", "default", "rayjobs", rayjob)
        ray = KubeRay(bare_play, rayjob["metadata"]["name"], 2, 4, POOLS)
        ray.kueue_queues("waiting")
        assert ray.kueue_admits() is None, path.name
        admission = bare_play.custom.get_namespaced_custom_object(*KUEUE_API, "default", "workloads", ray.workload)
        flavors = {a["name"]: sorted(set(a["flavors"].values())) for a in admission["status"]["admission"][
            "podSetAssignments"]}  # fmt: skip
        assert flavors == {"head": [kueue.CPU_FLAVOR], "slice": ["v6e-4x4"], "submitter": [kueue.CPU_FLAVOR]}
        finished = {"conditions": [{"type": "Finished", "status": "True", "reason": "Succeeded", "message": "done"}]}
        # Kueue releases a finished Workload's quota: the next stage's RayJob needs it
        bare_play.custom.patch_namespaced_custom_object_status(
            *KUEUE_API, "default", "workloads", ray.workload, {"status": finished}
        )
