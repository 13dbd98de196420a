"""provision's check of the cluster's KubeRay release, before any node pool (:mod:`multislice.backends.gke.kuberay`).

GKE's Ray Operator add-on runs the KubeRay its GKE version ships, possibly older than v1.7.0, and a KubeRay
upgraded with Helm keeps its first CRDs. Each scenario serves KubeRay's CRDs over HTTP from kmock's emulator
(tests/kube_cluster.py) and runs provision as the pipeline's ServiceAccount under the rendered RBAC, on a cluster
with the Ray Operator add-on (a recorded stand-in for ``nodepool.ray_operator_enabled``, as in
test_prerequisites.py). The older CRDs are v1.7.0's (multislice/crds/kuberay-v1.7.0, ray-project/kuberay commit
59d663ae) with the fields a later release added taken out, as :data:`.kuberay.RELEASE_FIELDS` dates them from
KubeRay's own commits: ``workerGroupSpecs[].priority`` (556d1b43d, #4942, first in v1.7.0) gives v1.6's; without
``spec.backoffLimit`` (8682b2d9c, #2192, v1.2.0) and the later ones, v1.1's. ``resourceClaims[]
.resourceClaimTemplateName`` (a pod's claim, Kubernetes 1.31's ``PodResourceClaim``) is declared by KubeRay's CRDs
from v1.3.1 (the Kubernetes API they are generated from: ``ray-operator/config/crd/bases/ray.io_rayjobs.yaml`` of
v1.3.0 has only ``source.resourceClaimTemplateName``). On a checkout without the check, provision went on to the
node pools with every one of these CRDs.
"""

from __future__ import annotations

import copy

import pytest

from multislice import config
from multislice.backends.gke import GkeBackend, cluster, kuberay, nodepool
from multislice.plan import make_plan
from multislice.render import kueue, rbac
from multislice.steps import provision
from tests.backends.gke.harness import POOLS
from tests.kube_controllers import Play, upstream_crds
from tests.kube_rbac import service_account_user

pytestmark = pytest.mark.usefixtures("run_storage")

#: Every stage launched by Ray, its workers claiming a DRANET network (so the pod spec's resourceClaims is rendered).
OVERRIDES = {
    "run_name": "r1",
    "output_dir": "gs://bucket/runs",
    "service_accounts.kueue_cluster_objects": True,
    "launcher": "ray",
    "node_pools.additional_node_networks": [{"network": "dcn-net", "subnetwork": "dcn-sub"}],
    "service_accounts.tpu_host_network": False,
}
KUBERAY_CRDS = (kuberay.RAYJOBS_CRD, kuberay.RAYCLUSTERS_CRD)
#: Where a RayCluster spec sits in each CRD's v1 schema.
CLUSTER_SPEC = {kuberay.RAYJOBS_CRD: "spec.rayClusterSpec", kuberay.RAYCLUSTERS_CRD: "spec"}
#: Fields KubeRay v1.2.0 to v1.7.0 added to the RayJob (RELEASE_FIELDS), RayCluster spec paths relative.
LATER_THAN_V1_1 = ["spec.backoffLimit", "spec.managedBy", "status.rayJobInfo", "spec.deletionStrategy",
                   "spec.preRunningDeadlineSeconds"]  # fmt: skip
CLAIM_TEMPLATE_NAME = "workerGroupSpecs[].template.spec.resourceClaims[].resourceClaimTemplateName"


@pytest.fixture
def plan():
    return make_plan(config.load_profile("gke-v6e-16x2-seed", OVERRIDES))


@pytest.fixture
def addon(monkeypatch):
    """The cluster has GKE's Ray Operator add-on (which also injects the TPU worker environment)."""
    monkeypatch.setattr(nodepool, "ray_operator_enabled", lambda plan, client=None: True)


@pytest.fixture
def ray_cluster(served, plan, addon, node_pools):
    """The emulated cluster without KubeRay's CRDs yet (:func:`install_kuberay` adds them), as the pipeline."""
    player = Play(served)
    player.install_crds(skip=KUBERAY_CRDS)
    player.nodes({pool: 4 for pool in POOLS})
    player.install_kueue(provision.kueue_objects(plan), kueue.kueue_configuration(plan))
    accounts = plan.spec.service_accounts
    user = service_account_user(accounts.pipeline_namespace or plan.spec.namespace, accounts.pipeline)
    served.as_user(user, rbac.render_rbac_objects(plan))
    return player


def _drop(schema: dict, path: str) -> None:
    """Remove the field at ``path`` (``a.b[].c``) from a v1 openAPIV3Schema; it must be there."""
    *parents, last = path.split(".")
    for part in parents:
        schema = schema["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            schema = schema["items"]
    del schema["properties"][last]


def install_kuberay(player: Play, *, dropped: tuple[str, ...] = (), cluster_dropped: tuple[str, ...] = (),
                    version_label: str | None = None) -> None:  # fmt: skip
    """KubeRay v1.7.0's CRDs, established, less ``dropped`` (RayJob fields) and ``cluster_dropped`` (RayCluster spec
    fields, relative; taken out of both CRDs, as KubeRay generates both from one type)."""
    for crd in upstream_crds():
        name = crd["metadata"]["name"]
        if name not in KUBERAY_CRDS:
            continue
        crd = copy.deepcopy(crd)
        schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
        for path in dropped if name == kuberay.RAYJOBS_CRD else ():
            _drop(schema, path)
        for path in cluster_dropped:
            _drop(schema, f"{CLUSTER_SPEC[name]}.{path}")
        if version_label:
            crd["metadata"].setdefault("labels", {})[kuberay.VERSION_KEY] = version_label
        crd["status"] = {"conditions": [{"type": "Established", "status": "True"}]}
        player.crds.create_custom_resource_definition(crd)


def test_kuberay_v1_7_crds_pass_and_provision_goes_on(served, plan, ray_cluster, node_pools, told):
    install_kuberay(ray_cluster)
    provision.run(plan, backend=GkeBackend(served.kube()))
    told.wait_for(
        r"KubeRay: rayjobs\.ray\.io and rayclusters\.ray\.io v1 declare every field of the rendered RayJob "
        r"\(stage\(s\) llama3-8b, llama3-70b\) and KubeRay v1\.7\.0's"
    )
    assert node_pools == ["r1"]
    assert served.cluster.authorizer.denied == []  # the CRD reads are in the rendered ClusterRole


def test_kuberay_v1_6_crds_are_refused_before_any_node_pool(served, plan, ray_cluster, node_pools):
    """Every field the RayJob renders is there, but KubeRay v1.7.0's is not: an older operator."""
    install_kuberay(ray_cluster, cluster_dropped=("workerGroupSpecs[].priority",))
    with pytest.raises(kuberay.KubeRayTooOld) as refused:
        provision.run(plan, backend=GkeBackend(served.kube()))
    error = refused.value
    assert error.message.startswith(
        "the cluster's KubeRay is older than v1.7.0, which the Ray launcher renders for: its CRDs declare the fields "
        "of KubeRay v1.6.0, the newest release they match (the CRDs record no version); not declared either: "
        "KubeRay v1.7.0's rayjobs.ray.io spec.rayClusterSpec.workerGroupSpecs[].priority and rayclusters.ray.io "
        "spec.workerGroupSpecs[].priority"
    ), error.message
    assert error.message.endswith("nothing was created") and "would drop" not in error.message
    assert "upgrade the cluster to a GKE version whose add-on ships it" in error.fix
    assert "kuberay/kuberay-operator --version 1.7.0" in error.fix and "ref=v1.7.0" in error.fix
    assert error.exit_code == 2
    assert node_pools == []


def test_kuberay_v1_1_crds_name_each_dropped_field_of_the_rendered_rayjob(served, plan, ray_cluster, node_pools):
    install_kuberay(
        ray_cluster, dropped=tuple(LATER_THAN_V1_1),
        cluster_dropped=("workerGroupSpecs[].priority", CLAIM_TEMPLATE_NAME), version_label="v1.1.1",
    )  # fmt: skip
    with pytest.raises(kuberay.KubeRayTooOld) as refused:
        provision.run(plan, backend=GkeBackend(served.kube()))
    message = refused.value.message
    assert "its CRDs declare the fields of KubeRay v1.1.0, the newest release they match " \
        "(app.kubernetes.io/version v1.1.1)" in message  # fmt: skip
    stages = "(stage(s) llama3-8b, llama3-70b)"
    assert f"the API server would drop or refuse these of the rendered RayJob: rayjobs.ray.io spec.backoffLimit: " \
        f"not declared {stages}; " in message  # fmt: skip
    assert f"rayjobs.ray.io spec.rayClusterSpec.{CLAIM_TEMPLATE_NAME}: not declared {stages}" in message
    assert f"rayclusters.ray.io spec.{CLAIM_TEMPLATE_NAME}: not declared {stages}" in message
    # Fields the RayJob does not render are not named as dropped.
    assert "spec.managedBy" not in message and "deletionStrategy" not in message
    assert node_pools == []


def test_a_cluster_without_the_raycluster_crd_is_refused(served, plan, ray_cluster, node_pools):
    install_kuberay(ray_cluster)
    Play(served).crds.delete_custom_resource_definition(kuberay.RAYCLUSTERS_CRD)
    with pytest.raises(cluster.CrdsMissing, match=r"rayclusters\.ray\.io needs v1, the cluster serves nothing"):
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert node_pools == []


def test_schema_gaps_follow_the_api_servers_pruning():
    """Declared, map (``additionalProperties``), ``x-kubernetes-preserve-unknown-fields`` and an embedded resource's
    ``apiVersion``/``kind``/``metadata`` are kept; anything else is a gap, as are a value outside an ``enum`` and a
    required field without a default that is not rendered (apiextensions-apiserver ``schema/pruning/algorithm.go``,
    ``schema/defaulting``)."""
    schema = {
        "type": "object",
        "required": ["a", "d"],
        "properties": {
            "a": {"type": "string", "enum": ["x"]},
            "d": {"type": "integer", "default": 1},
            "m": {"type": "object", "additionalProperties": {"type": "object", "properties": {"k": {}}}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "obj": {"type": "object", "x-kubernetes-embedded-resource": True, "properties": {"spec": {}}},
            "items": {"type": "array", "items": {"type": "object", "properties": {"n": {}}}},
        },
    }
    obj = {
        "apiVersion": "v1",
        "metadata": {"anything": 1},
        "a": "y",
        "m": {"one": {"k": 1, "extra": 2}},
        "free": {"anything": {"deep": 1}},
        "obj": {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": {}, "status": {}},
        "items": [{"n": 1, "gone": 1}, {"gone": 2}],
        "unknown": 1,
    }
    assert kuberay.schema_gaps(schema, obj, root=True) == [
        "a: 'y' not in the enum ['x']",
        "m.one.extra: not declared",
        "obj.status: not declared",
        "items[].gone: not declared",
        "unknown: not declared",
    ]
    assert kuberay.schema_gaps(schema, {}, root=True) == ["a: required, not rendered"]
