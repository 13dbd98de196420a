"""RBAC objects: least privilege, exact verbs and resources, Workload Identity, no credentials in compiled YAML."""

from __future__ import annotations

import json
import re

import pytest

from multislice import config
from multislice.plan import make_plan
from multislice.render import jobset, rbac, schema
from tests.golden import compiled_pipeline

TRAINER_GSA = "multislice-trainer@your-project.iam.gserviceaccount.com"


def objects(**overrides):
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed", overrides))
    return {(o["kind"], o["metadata"]["name"]): o for o in rbac.render_rbac_objects(plan)}


def rules_table(obj):
    """{(apiGroup, resource): (verbs, resourceNames)} of a Role or ClusterRole."""
    table = {}
    for rule in obj["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in table, f"{group}/{resource} granted twice"
                table[(group, resource)] = (sorted(rule["verbs"]), rule.get("resourceNames"))
    return table


def test_namespaced_role_grants_exactly_what_the_steps_use():
    role = objects()[("Role", "multislice-pipeline")]
    assert role["metadata"]["namespace"] == "default"
    assert rules_table(role) == {
        ("jobset.x-k8s.io", "jobsets"): (["create", "delete", "get", "list", "watch"], None),
        ("batch", "jobs"): (["create", "delete", "get", "list", "watch"], None),
        ("", "pods"): (["get", "list", "watch"], None),
        ("", "pods/log"): (["get"], None),
        ("", "events"): (["get", "list", "watch"], None),
        ("kueue.x-k8s.io", "workloads"): (["get", "list", "watch"], None),
        ("kueue.x-k8s.io", "localqueues"): (["create", "get", "patch"], ["multislice-queue"]),
        ("coordination.k8s.io", "leases"): (["create", "delete", "get", "list", "patch"], None),
        # launcher is a run parameter of the compiled pipeline: a run may pick ray on a jobset profile.
        ("ray.io", "rayjobs"): (["create", "delete", "get", "list", "watch"], None),
        ("resource.k8s.io", "resourceclaimtemplates"): (["create", "delete", "get", "list"], None),
    }


def test_cluster_wide_rights_are_reads_of_crds_nodes_and_the_run_cluster_queue_only():
    objs = objects()
    cluster_roles = [o for (kind, _), o in objs.items() if kind == "ClusterRole"]
    assert len(cluster_roles) == 1
    assert rules_table(cluster_roles[0]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions"): (["get", "list"], None),
        ("", "nodes"): (["get", "list", "watch"], None),
        ("kueue.x-k8s.io", "clusterqueues"): (["get"], ["multislice-cluster-queue"]),  # elastic: what Kueue admits
        # provision, a Ray run: the KubeRay TPU webhook is installed (launcher is a run parameter).
        ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): (
            ["get"],
            ["kuberay-tpu-mutating-webhook-cfg"],
        ),  # fmt: skip
    }
    binding = objs[("ClusterRoleBinding", "multislice-pipeline-cluster-read-default")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "multislice-pipeline-cluster-read",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "multislice-pipeline", "namespace": "default"}]


def test_required_access_is_the_plans_own_launchers_rules_one_review_each():
    """provision's SelfSubjectAccessReviews (rbac.required_access) come from the rules the Role is rendered from."""
    jobset_plan = make_plan(config.load_profile("gke-v6e-16x2-seed", {}))
    ray_plan = make_plan(config.load_profile("gke-v6e-16x2-seed", {"launcher": "ray"}))
    jobset_only, with_ray = rbac.required_access(jobset_plan), rbac.required_access(ray_plan)
    log = {"namespace": "default", "verb": "get", "group": "", "resource": "pods", "subresource": "log", "name": ""}
    create = {"namespace": "default", "verb": "create", "group": "ray.io", "resource": "rayjobs", "subresource": "",
              "name": ""}  # fmt: skip
    webhook = {"namespace": "", "verb": "get", "group": "admissionregistration.k8s.io",
               "resource": "mutatingwebhookconfigurations", "subresource": "",
               "name": "kuberay-tpu-mutating-webhook-cfg"}  # fmt: skip
    assert log in jobset_only and create not in jobset_only and webhook not in jobset_only
    assert create in with_ray and webhook in with_ray
    # One review per verb, resource and name: the Role's rules expanded, nothing else.
    role = objects()[("Role", "multislice-pipeline")]
    namespaced = [a for a in with_ray if a["namespace"] == "default"]
    expected = sum(len(r["verbs"]) * len(r["resources"]) * len(r.get("resourceNames") or [""]) for r in role["rules"])
    assert len(namespaced) == expected


def test_kueue_cluster_objects_are_granted_by_name_only_when_asked():
    objs = objects(**{"service_accounts.kueue_cluster_objects": True})
    role = objs[("ClusterRole", "multislice-pipeline-kueue-multislice-cluster-queue")]
    assert rules_table(role) == {
        ("kueue.x-k8s.io", "resourceflavors"): (["create", "get", "patch"], ["v6e-4x4", "multislice-cpu"]),
        ("kueue.x-k8s.io", "clusterqueues"): (["create", "get", "patch"], ["multislice-cluster-queue"]),
        ("kueue.x-k8s.io", "workloadpriorityclasses"): (["create", "get", "patch"], ["default-priority"]),
    }
    assert ("ClusterRoleBinding", "multislice-pipeline-kueue-multislice-cluster-queue-default") in objs


DRANET = {
    "launcher": "ray",
    "node_pools.additional_node_networks": [{"network": "dcn-net", "subnetwork": "dcn-sub"}],
    "service_accounts.tpu_host_network": False,
}


def test_a_ray_run_may_apply_its_cpu_flavor_and_with_dranet_read_kueues_configuration_only():
    objs = objects(**{"service_accounts.kueue_cluster_objects": True, **DRANET})
    role = objs[("ClusterRole", "multislice-pipeline-kueue-multislice-cluster-queue")]
    assert rules_table(role)[("kueue.x-k8s.io", "resourceflavors")] == (
        ["create", "get", "patch"], ["v6e-4x4", "multislice-cpu"]
    )  # fmt: skip
    config_role = objs[("Role", "multislice-pipeline-kueue-config")]
    assert config_role["metadata"]["namespace"] == "kueue-system"
    assert rules_table(config_role) == {("", "configmaps"): (["get"], ["kueue-manager-config"])}
    binding = objs[("RoleBinding", "multislice-pipeline-kueue-config-default")]
    assert binding["metadata"]["namespace"] == "kueue-system"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "multislice-pipeline", "namespace": "default"}]
    # Without DRANET (or without Ray) the pipeline gets nothing in Kueue's namespace.
    assert not [k for k in objects(launcher="ray") if k[1] == "multislice-pipeline-kueue-config"]


def test_trainer_has_workload_identity_and_only_the_in_place_restart_agents_api_rights():
    objs = objects()
    trainer = objs[("ServiceAccount", "multislice-trainer")]
    assert trainer["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": TRAINER_GSA}
    assert trainer["automountServiceAccountToken"] is False
    for (kind, name), obj in objs.items():
        if kind.endswith("Binding") and name != "multislice-trainer-in-place-restart":
            assert all(s["name"] != "multislice-trainer" for s in obj.get("subjects", []))
    # the agent's Role (multislice.render.in_place; tests/render/test_in_place.py), and with Recreate nothing
    assert rules_table(objs[("Role", "multislice-trainer-in-place-restart")]) == {
        ("", "pods"): (["patch"], None), ("jobset.x-k8s.io", "jobsets"): (["get", "list", "watch"], None),
    }  # fmt: skip
    recreate = objects(restart_strategy="recreate")
    for (kind, _), obj in recreate.items():
        if kind.endswith("Binding"):
            assert all(s["name"] != "multislice-trainer" for s in obj.get("subjects", []))
    plain = objects(**{"service_accounts.trainer_gcp_service_account": None})
    assert "annotations" not in plain[("ServiceAccount", "multislice-trainer")]["metadata"]


def test_tpu_pods_run_as_the_trainer_service_account():
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed", {"service_accounts.trainer": "llama-trainer"}))
    js = jobset.render_jobset(plan, plan.stages[0], hardware="tpu", pipeline_run_id="r")
    assert js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["serviceAccountName"] == (
        "llama-trainer"
    )


def test_pipeline_account_in_another_namespace_and_vertex_identity():
    objs = objects(
        **{
            "service_accounts.pipeline_namespace": "kubeflow",
            "service_accounts.pipeline_gcp_service_account": "pipelines@my-project.iam.gserviceaccount.com",
        }
    )
    pipeline = objs[("ServiceAccount", "multislice-pipeline")]
    assert pipeline["metadata"]["namespace"] == "kubeflow"
    assert pipeline["metadata"]["annotations"] == {
        "iam.gke.io/gcp-service-account": "pipelines@my-project.iam.gserviceaccount.com"
    }
    assert "automountServiceAccountToken" not in pipeline  # the components use the Kubernetes API
    binding = objs[("RoleBinding", "multislice-pipeline")]
    assert binding["metadata"]["namespace"] == "default"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "multislice-pipeline", "namespace": "kubeflow"},
        {
            "kind": "User",
            "apiGroup": "rbac.authorization.k8s.io",
            "name": "pipelines@my-project.iam.gserviceaccount.com",
        },
    ]
    assert ("ClusterRoleBinding", "multislice-pipeline-cluster-read-kubeflow") in objs


def test_kfp_runner_role_grants_what_kfp_and_argo_ask_in_the_pipeline_namespace_only():
    """KFP runs the Argo Workflow as the run's ServiceAccount: its driver, launcher and Argo's executor get exactly
    their requests (rbac.KFP_RUNNER_REQUESTS), where KFP's pods run, bound to the ServiceAccount and no User."""
    objs = objects(
        **{
            "service_accounts.pipeline_namespace": "kubeflow",
            "service_accounts.pipeline_gcp_service_account": "pipelines@my-project.iam.gserviceaccount.com",
        }
    )
    role = objs[("Role", "multislice-pipeline-kfp-runner")]
    assert role["metadata"]["namespace"] == "kubeflow"
    assert rules_table(role) == {
        ("", "configmaps"): (["get"], ["kfp-launcher"]),
        ("", "secrets"): (["get"], ["mlpipeline-minio-artifact"]),
        ("argoproj.io", "workflowtaskresults"): (["create", "patch"], None),
        # KFP's MLflow plugin: the driver and launcher call MLflow with the pod's token, checked on these.
        ("mlflow.kubeflow.org", "experiments"): (["create", "get", "list", "update"], None),
    }
    binding = objs[("RoleBinding", "multislice-pipeline-kfp-runner")]
    assert binding["metadata"]["namespace"] == "kubeflow"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "multislice-pipeline", "namespace": "kubeflow"}]
    custom = objects(**{"service_accounts.kfp_artifact_secrets": ["s3-creds"]})
    assert rules_table(custom[("Role", "multislice-pipeline-kfp-runner")])[("", "secrets")] == (["get"], ["s3-creds"])
    none = objects(**{"service_accounts.kfp_artifact_secrets": []})
    assert ("", "secrets") not in rules_table(none[("Role", "multislice-pipeline-kfp-runner")])
    # Every granted request is one of KFP's or Argo's, from their source.
    granted = {(group, resource, verb) for (group, resource), (verbs, _) in rules_table(role).items() for verb in verbs}
    assert granted == {(r[2], r[3], r[1]) for r in rbac.KFP_RUNNER_REQUESTS}


def test_every_rbac_object_validates_and_problems_are_found():
    for obj in objects(**{"service_accounts.kueue_cluster_objects": True}).values():
        assert rbac.problems(obj) == [], obj["metadata"]["name"]
    objs = objects()
    role = objs[("Role", "multislice-pipeline")]
    role["rules"][0]["verbs"].append("escalate-all")
    role["rules"][1]["resources"] = ["*"]
    del role["metadata"]["namespace"]
    found = rbac.problems(role)
    assert any("rules[0].verbs" in p for p in found)
    assert any("rules[1]: name resources" in p for p in found)
    assert "metadata.namespace: a namespaced object needs a namespace" in found
    cluster_role = objs[("ClusterRole", "multislice-pipeline-cluster-read")]
    cluster_role["metadata"]["namespace"] = "default"
    cluster_role["metadata"]["name"] = "Bad_Name"
    found = rbac.problems(cluster_role)
    assert "metadata.namespace: a cluster-scoped object has no namespace" in found
    assert any("'Bad_Name' is not a DNS-1123 subdomain" in p for p in found)
    binding = objs[("ClusterRoleBinding", "multislice-pipeline-cluster-read-default")]
    binding["roleRef"]["kind"] = "Role"
    binding["subjects"][0].pop("namespace")
    found = rbac.problems(binding)
    assert "roleRef.kind: a ClusterRoleBinding can only refer to a ClusterRole" in found
    assert "subjects[0].namespace: a ServiceAccount subject needs its namespace" in found
    with pytest.raises(KeyError, match="not a built-in kind"):
        schema.builtin_problems({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"service_accounts.trainer": "multislice-pipeline"}, "service_accounts"),
        ({"service_accounts.trainer_gcp_service_account": "someone@gmail.com"}, "trainer_gcp_service_account"),
        ({"service_accounts.pipeline": "Pipeline"}, "service_accounts.pipeline"),
        ({"service_accounts.kfp_artifact_secrets": ["Bad_Secret"]}, "service_accounts.kfp_artifact_secrets"),
    ],
)
def test_service_account_errors_name_the_field(overrides, field):
    with pytest.raises(config.ConfigError) as caught:
        config.load_profile("gke-v6e-16x2-seed", overrides)
    [(where, _)] = caught.value.issues
    assert field in where


#: What a credential looks like in text: OAuth access tokens, JWTs, PEM keys, service-account key
#: fields, kubeconfig credentials, Authorization headers.
CREDENTIAL = re.compile(
    r"ya29\.[\w-]+|eyJ[\w-]{10,}\.[\w-]{10,}|-----BEGIN [A-Z ]*PRIVATE KEY-----|\"private_key(_id)?\"|"
    r"client-(key|certificate)-data|\btoken:\s*\S|[Bb]earer\s+[\w.-]{8,}|client_secret|password\s*[:=]",
)


def test_compiled_gke_pipeline_holds_no_credentials(tmp_path, monkeypatch):
    # Credentials a developer's machine may hold while compiling: none of them may reach the YAML.
    access_token = "ya29.a0AfB_secret-access-token-value"
    key = {
        "type": "service_account",
        "private_key_id": "0123456789abcdef",
        "private_key": "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBg\n-----END PRIVATE KEY-----\n",
        "client_email": "deployer@my-project.iam.gserviceaccount.com",
    }
    (tmp_path / "key.json").write_text(json.dumps(key))
    kube_token = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW0ifQ.c2lnbmF0dXJl"
    (tmp_path / "kubeconfig").write_text(
        "apiVersion: v1\nkind: Config\nusers:\n- name: u\n  user:\n    token: " + kube_token + "\n"
    )
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "key.json"))
    monkeypatch.setenv("CLOUDSDK_AUTH_ACCESS_TOKEN", access_token)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))

    text = compiled_pipeline("gke-v6e-16x2-seed")
    for secret in (access_token, kube_token, key["private_key_id"], "MIIEvQIBADANBg", str(tmp_path)):
        assert secret not in text
    assert CREDENTIAL.findall(text) == []
    # The detector itself finds each kind of credential it claims to.
    for leaked in (
        access_token,
        kube_token,
        key["private_key"],
        json.dumps(key),
        "    token: abc",
        "Bearer abcdefgh12",
    ):
        assert CREDENTIAL.search(text + leaked), leaked
