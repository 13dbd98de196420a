"""provision's checks before any node pool is created: the pipeline's rights (SelfSubjectAccessReview, answered by
the emulator from the RBAC it enforces) and, for a stage launched by Ray, the KubeRay TPU webhook or GKE's Ray
Operator add-on (:mod:`multislice.backends.gke.prerequisites`).

Each scenario runs provision as the pipeline's ServiceAccount against kmock's emulator (tests/kube_cluster.py) with
``ensure_node_pools`` recorded (the ``node_pools`` fixture): a refusal must come before the first node pool call.
On a checkout without these checks, provision went on to the node pools in each refusing scenario below.
"""

from __future__ import annotations

import copy

import pytest
from kubernetes import client as k8s

from multislice import config
from multislice.backends.gke import GkeBackend, nodepool, prerequisites
from multislice.config import parameters
from multislice.plan import make_plan
from multislice.render import launchers, rbac
from multislice.steps import provision
from tests.kube_rbac import Authorizer, service_account_user

pytestmark = pytest.mark.usefixtures("run_storage")

BASE = {"run_name": "r1", "output_dir": "gs://bucket/runs", "service_accounts.kueue_cluster_objects": True}

#: The KubeRay TPU webhook's MutatingWebhookConfiguration as its manifests create it (GoogleCloudPlatform/ai-on-gke,
#: commit 2561974a, ray-on-gke/tpu/kuberay-tpu-webhook/deployments/mutating-webhook-cfg.yaml; the Helm chart's
#: template is the same with the namespace templated).
TPU_WEBHOOK = {
    "apiVersion": "admissionregistration.k8s.io/v1",
    "kind": "MutatingWebhookConfiguration",
    "metadata": {
        "name": "kuberay-tpu-mutating-webhook-cfg",
        "annotations": {"cert-manager.io/inject-ca-from": "ray-system/kuberay-tpu-webhook-certs"},
    },
    "webhooks": [
        {
            "name": "kuberay-tpu-webhook.ray-system.svc",
            "admissionReviewVersions": ["v1"],
            "sideEffects": "NoneOnDryRun",
            "namespaceSelector": {
                "matchExpressions": [
                    {
                        "key": "kubernetes.io/metadata.name",
                        "operator": "NotIn",
                        "values": ["kube-system", "kube-node-lease"],
                    }
                ]
            },  # fmt: skip
            "clientConfig": {"service": {"name": "kuberay-tpu-webhook", "namespace": "ray-system", "path": "/mutate"}},
            "rules": [
                {
                    "operations": ["CREATE"],
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["pods"],
                    "scope": "Namespaced",
                }
            ],  # fmt: skip
            "objectSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay"}},
        }
    ],
}


def make(**overrides):
    return make_plan(config.load_profile("gke-v6e-16x2-seed", {**BASE, **overrides}))


@pytest.fixture
def addon(monkeypatch):
    """GKE's answer for the Ray Operator add-on (tested against the GKE fake in test_nodepool.py), recorded."""
    asked: list[str] = []
    state = {"enabled": False}

    def ray_operator_enabled(plan, client=None):
        asked.append(plan.spec.cluster.name)
        return state["enabled"]

    monkeypatch.setattr(nodepool, "ray_operator_enabled", ray_operator_enabled)
    return state, asked


def as_pipeline(served, plan, rbac_objects):
    accounts = plan.spec.service_accounts
    served.as_user(service_account_user(accounts.pipeline_namespace or plan.spec.namespace, accounts.pipeline),
                   rbac_objects)  # fmt: skip


def jobset_only_rbac(plan, monkeypatch):
    """The RBAC a profile with ``launcher: jobset`` rendered before the run form's ``launcher`` was covered: the
    same render with ``launcher`` not offered by the compiled pipeline."""
    with monkeypatch.context() as patched:
        patched.setattr(parameters, "remote_run_sets", lambda path: False)
        return rbac.render_rbac_objects(plan)


# -- the KubeRay TPU webhook ------------------------------------------------------------------------------------


def test_a_ray_run_on_a_cluster_without_the_tpu_webhook_fails_before_any_node_pool(served, play, node_pools, addon):
    plan = make(launcher="ray")
    as_pipeline(served, plan, rbac.render_rbac_objects(plan))
    with pytest.raises(prerequisites.PrerequisiteMissing) as refused:
        provision.run(plan, backend=GkeBackend(served.kube()))
    error = refused.value
    assert "neither the KubeRay TPU webhook (no MutatingWebhookConfiguration kuberay-tpu-mutating-webhook-cfg) " \
        "nor GKE's Ray Operator add-on" in error.message  # fmt: skip
    assert "TPU_WORKER_HOSTNAMES" in error.message and "stage(s) llama3-8b, llama3-70b" in error.message
    assert "--update-addons=RayOperator=ENABLED" in error.fix and "kuberay-tpu-webhook" in error.fix
    assert error.exit_code == 2
    assert node_pools == []  # refused before the node pools
    assert addon[1] == ["your-cluster"]  # the add-on was asked only once the webhook was found missing


def test_a_ray_run_with_the_tpu_webhook_installed_provisions(served, play, node_pools, addon, told):
    plan = make(launcher="ray")
    k8s.AdmissionregistrationV1Api(served.api(admin=True)).create_mutating_webhook_configuration(TPU_WEBHOOK)
    as_pipeline(served, plan, rbac.render_rbac_objects(plan))
    provision.run(plan, backend=GkeBackend(served.kube()))
    told.wait_for(r"KubeRay TPU webhook: MutatingWebhookConfiguration kuberay-tpu-mutating-webhook-cfg mutates pod")
    assert node_pools == ["r1"]
    assert addon[1] == []  # found in the cluster: the GKE API is not asked
    assert served.cluster.authorizer.denied == []


def test_a_ray_run_on_a_cluster_with_the_ray_operator_add_on_provisions(served, play, node_pools, addon, told):
    plan = make(launcher="ray")
    addon[0]["enabled"] = True
    as_pipeline(served, plan, rbac.render_rbac_objects(plan))
    provision.run(plan, backend=GkeBackend(served.kube()))
    told.wait_for(r"KubeRay TPU webhook: GKE's Ray Operator add-on is enabled")
    assert node_pools == ["r1"]


def test_a_webhook_configuration_that_does_not_mutate_pod_creation_is_refused(served, play, node_pools, addon):
    plan = make(launcher="ray")
    broken = copy.deepcopy(TPU_WEBHOOK)
    broken["webhooks"][0]["rules"][0]["operations"] = ["UPDATE"]
    k8s.AdmissionregistrationV1Api(served.api(admin=True)).create_mutating_webhook_configuration(broken)
    as_pipeline(served, plan, rbac.render_rbac_objects(plan))
    with pytest.raises(prerequisites.PrerequisiteMissing, match="none of its webhooks mutates pod CREATE"):
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert node_pools == []


def test_a_jobset_run_needs_no_tpu_webhook(served, play, node_pools, addon):
    plan = make()
    as_pipeline(served, plan, rbac.render_rbac_objects(plan))
    provision.run(plan, backend=GkeBackend(served.kube()))
    assert node_pools == ["r1"] and addon[1] == []


# -- RBAC for what the run form offers ------------------------------------------------------------------------


def test_the_rendered_rbac_covers_ray_when_the_run_form_offers_launcher():
    """``launcher`` is a run parameter of the compiled pipeline: a jobset profile's Role has the Ray rules too."""
    plan = make()
    assert parameters.remote_run_sets("launcher")
    role = next(o for o in rbac.render_rbac_objects(plan) if o["kind"] == "Role")
    assert {"apiGroups": ["ray.io"], "resources": ["rayjobs"],
            "verbs": ["get", "list", "watch", "create", "delete"]} in role["rules"]  # fmt: skip
    reader = next(o for o in rbac.render_rbac_objects(plan) if o["kind"] == "ClusterRole")
    webhook_rule = {"apiGroups": ["admissionregistration.k8s.io"], "resources": ["mutatingwebhookconfigurations"],
                    "verbs": ["get"], "resourceNames": [launchers.TPU_WEBHOOK_CONFIGURATION]}  # fmt: skip
    assert webhook_rule in reader["rules"]
    # What a jobset run checks stays the jobset's: no Ray request is reviewed for it.
    assert not [a for a in rbac.required_access(plan) if a["group"] in ("ray.io", "admissionregistration.k8s.io")]


def test_ray_picked_in_the_run_form_on_a_jobset_only_rbac_is_refused_before_any_node_pool(
    served, play, node_pools, addon, monkeypatch
):
    plan = make(launcher="ray")  # the run form's launcher=ray on the default (jobset) profile
    as_pipeline(served, plan, jobset_only_rbac(make(), monkeypatch))
    with pytest.raises(prerequisites.AccessMissing) as refused:
        provision.run(plan, backend=GkeBackend(served.kube()))
    error = refused.value
    assert 'get, list, watch, create, delete rayjobs.ray.io in namespace "default"' in error.message
    assert "mutatingwebhookconfigurations.admissionregistration.k8s.io \"kuberay-tpu-mutating-webhook-cfg\" " \
        "cluster-wide" in error.message  # fmt: skip
    assert "kubectl apply -f" in error.fix and "rbac-*.yaml" in error.fix
    assert node_pools == [] and addon[1] == []
    # Reviews, not requests: nothing the pipeline may not do was tried.
    assert served.cluster.authorizer.denied == []


def test_ray_picked_in_the_run_form_on_the_new_render_passes_the_rbac_check(served, play, node_pools, addon, told):
    plan = make(launcher="ray")
    addon[0]["enabled"] = True
    as_pipeline(served, plan, rbac.render_rbac_objects(make()))  # the default profile's render, as applied
    provision.run(plan, backend=GkeBackend(served.kube()))
    told.wait_for(r"RBAC: the pipeline may make all \d+ requests of this run's steps \(SelfSubjectAccessReview\)")
    assert node_pools == ["r1"]


def test_a_jobset_run_on_a_jobset_only_rbac_still_passes(served, play, node_pools, monkeypatch):
    """Clusters set up from an earlier render keep running JobSet stages: only the run's own launchers' requests are
    checked. Where the pipeline applies the cluster-scoped Kueue objects itself (``kueue_cluster_objects``), the
    queue it applies now also has the CPU flavor a run switched to Ray needs (as the rendered RBAC covers Ray), so
    that earlier RBAC is refused before any node pool, naming the flavor and the fix."""
    plan = make(**{"service_accounts.kueue_cluster_objects": True})
    as_pipeline(served, plan, jobset_only_rbac(plan, monkeypatch))
    with pytest.raises(prerequisites.AccessMissing, match=r'resourceflavors\.kueue\.x-k8s\.io "multislice-cpu"'):
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert node_pools == []
    admin_applied = make(**{"service_accounts.kueue_cluster_objects": False})
    as_pipeline(served, admin_applied, jobset_only_rbac(admin_applied, monkeypatch))
    provision.run(admin_applied, backend=GkeBackend(served.kube()))
    assert node_pools == ["r1"]


def test_a_role_missing_one_verb_names_that_verb(served, play, node_pools):
    plan = make()
    objects = rbac.render_rbac_objects(plan)
    role = next(o for o in objects if o["kind"] == "Role")
    jobsets = next(r for r in role["rules"] if r["resources"] == ["jobsets"])
    jobsets["verbs"].remove("delete")
    as_pipeline(served, plan, objects)
    with pytest.raises(prerequisites.AccessMissing, match=r'Missing: delete jobsets\.jobset\.x-k8s\.io in namespace '
                       r'"default"\nfix: apply the RBAC'):  # fmt: skip
        provision.run(plan, backend=GkeBackend(served.kube()))
    assert node_pools == []


# -- the emulator's SelfSubjectAccessReview ---------------------------------------------------------------------


def review(served, **attributes):
    api = k8s.AuthorizationV1Api(served.api())
    body = k8s.V1SelfSubjectAccessReview(
        spec=k8s.V1SelfSubjectAccessReviewSpec(resource_attributes=k8s.V1ResourceAttributes(**attributes))
    )
    return api.create_self_subject_access_review(body).status


def test_the_emulator_answers_self_subject_access_reviews_from_the_rbac_it_enforces(served):
    plan = make()
    objects = rbac.render_rbac_objects(plan)
    as_pipeline(served, plan, objects)
    allowed = review(served, namespace="default", verb="create", group="jobset.x-k8s.io", resource="jobsets")
    assert allowed.allowed is True
    assert allowed.reason == ('RBAC: allowed by RoleBinding "multislice-pipeline/default" of Role '
                              '"multislice-pipeline" to ServiceAccount "multislice-pipeline/default"')  # fmt: skip
    cluster = review(served, verb="get", group="kueue.x-k8s.io", resource="clusterqueues",
                     name="multislice-cluster-queue")  # fmt: skip
    assert cluster.allowed and cluster.reason.startswith('RBAC: allowed by ClusterRoleBinding "multislice-pipeline-')
    # resourceNames: another name, or no name (a list), is not allowed; nor another namespace, verb or subresource.
    assert not review(served, verb="get", group="kueue.x-k8s.io", resource="clusterqueues", name="other").allowed
    assert not review(served, verb="list", group="kueue.x-k8s.io", resource="clusterqueues").allowed
    assert not review(served, namespace="other", verb="create", group="jobset.x-k8s.io", resource="jobsets").allowed
    assert not review(served, namespace="default", verb="update", group="jobset.x-k8s.io", resource="jobsets").allowed
    assert review(served, namespace="default", verb="get", group="", resource="pods", subresource="log").allowed
    assert not review(served, namespace="default", verb="get", group="", resource="pods", subresource="exec").allowed
    denied = review(served, namespace="default", verb="create", group="", resource="secrets")
    assert denied.allowed is False and not denied.reason
    # The reviews agree with what the emulator enforces on the requests themselves.
    authorizer = Authorizer(objects)
    user = served.user
    for attributes in rbac.required_access(plan):
        resource = attributes["resource"] + (f"/{attributes['subresource']}" if attributes["subresource"] else "")
        assert authorizer.allowed(user, attributes["verb"], attributes["group"], resource,
                                  attributes["namespace"] or None, attributes["name"] or None)  # fmt: skip
