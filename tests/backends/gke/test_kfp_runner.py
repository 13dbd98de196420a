"""KFP's own requests as the run's ServiceAccount, against the rendered RBAC, on the emulated API server.

KFP runs the whole Argo Workflow as the run's ServiceAccount, so the KFP driver,
the KFP launcher and Argo's executor call the API with the same token as the
pipeline's components (tests/kfp_runner.py replays them, from KFP 2.17.0's and
Argo v4.0.5's source). The emulated API server enforces the RBAC ``multislice
render`` writes (tests/kube_rbac.py). Without the ``<pipeline>-kfp-runner`` Role
(the render before it existed) the first driver pod is refused the
``kfp-launcher`` ConfigMap and the run fails there.
"""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client as k8s

from multislice import config
from multislice.plan import make_plan
from multislice.render import rbac
from tests.kfp_runner import ARGO_GROUP, ARGO_VERSION, TASK_RESULTS, KfpPodFailed, replay_task
from tests.kube_cluster import Served
from tests.kube_rbac import service_account_user

WORKFLOW = "multislice-training-x7k2p"


@pytest.fixture
def served():
    server = Served()
    yield server
    server.stop()


def _plan(**overrides):
    return make_plan(
        config.load_profile("gke-v6e-16x2-seed", {"run_name": "r1", "output_dir": "gs://bucket/runs", **overrides})
    )


def _kfp_installed(served: Served, namespace: str, launcher_config: bool) -> None:
    """What a KFP install leaves in the run's namespace: the artifact store's Secret, maybe ``kfp-launcher``."""
    core = k8s.CoreV1Api(served.api(admin=True))
    core.create_namespaced_secret(
        namespace,
        {"metadata": {"name": "mlpipeline-minio-artifact"}, "data": {"accesskey": "YQ==", "secretkey": "Yg=="}},
    )
    if launcher_config:
        core.create_namespaced_config_map(
            namespace, {"metadata": {"name": "kfp-launcher"}, "data": {"defaultPipelineRoot": "gs://bucket/runs/root"}}
        )


def _run(served: Served, plan, objects) -> list:
    """Replay a run's first pod (root DAG driver) and two task pods as the pipeline's ServiceAccount."""
    accounts = plan.spec.service_accounts
    namespace = accounts.pipeline_namespace or plan.spec.namespace
    served.as_user(service_account_user(namespace, accounts.pipeline), objects)
    api = served.api()
    uid = str(uuid.uuid4())
    replays = [
        replay_task(api, namespace, workflow=WORKFLOW, workflow_uid=uid, node_id=f"{WORKFLOW}-{n}",
                    artifact_secrets=accounts.kfp_artifact_secrets, root_dag=n == 1)
        for n in (1, 2, 3)
    ]  # fmt: skip
    return replays


@pytest.mark.parametrize(
    ("overrides", "launcher_config"),
    [
        ({"service_accounts.pipeline_namespace": "kubeflow"}, False),  # KFP standalone: its pods in kubeflow
        ({"namespace": "team-a"}, True),  # multi-user Kubeflow: the profile's namespace is the run's
    ],
    ids=["standalone", "multi-user"],
)
def test_kfp_driver_launcher_and_argo_executor_run_under_the_rendered_role(served, overrides, launcher_config):
    plan = _plan(**overrides)
    namespace = plan.spec.service_accounts.pipeline_namespace or plan.spec.namespace
    _kfp_installed(served, namespace, launcher_config)
    replays = _run(served, plan, rbac.render_rbac_objects(plan))
    assert replays[0].requests[0] == (
        "KFP driver",
        "get",
        "configmaps",
        "kfp-launcher",
        200 if launcher_config else 404,
    )
    assert replays[0].launcher_config == ({"defaultPipelineRoot": "gs://bucket/runs/root"} if launcher_config else None)
    for replay in replays:
        assert ("KFP launcher", "get", "secrets", "mlpipeline-minio-artifact", 200) in replay.requests
        assert [r[1] for r in replay.requests if r[0] == "Argo executor"] == ["create", "patch", "patch"]
    results = k8s.CustomObjectsApi(served.api(admin=True)).list_namespaced_custom_object(
        ARGO_GROUP, ARGO_VERSION, namespace, TASK_RESULTS
    )["items"]
    assert sorted(r["metadata"]["name"] for r in results) == [f"{WORKFLOW}-{n}" for n in (1, 2, 3)]
    assert {r["metadata"]["labels"]["workflows.argoproj.io/report-outputs-completed"] for r in results} == {"true"}
    assert served.cluster.authorizer.denied == []


def test_the_role_before_the_kfp_runner_role_fails_at_the_first_driver_pod(served):
    """The render as it was (Role, ClusterRole, no ``-kfp-runner`` Role): KFP's driver is refused ``kfp-launcher``."""
    plan = _plan(**{"service_accounts.pipeline_namespace": "kubeflow"})
    _kfp_installed(served, "kubeflow", launcher_config=False)
    before = [o for o in rbac.render_rbac_objects(plan) if not o["metadata"]["name"].endswith("-kfp-runner")]
    with pytest.raises(KfpPodFailed, match=r"KFP driver: get configmaps 'kfp-launcher' in 'kubeflow' refused .*"
                                           r"cannot get resource \"configmaps\".*env.go FromConfigMap"):  # fmt: skip
        _run(served, plan, before)


@pytest.mark.parametrize(
    ("dropped", "refused"),
    [
        ("secrets", r"KFP launcher: get secrets 'mlpipeline-minio-artifact' .* the component fails"),
        ("workflowtaskresults", r"Argo executor: create workflowtaskresults .* the step never completes"),
    ],
)
def test_each_kfp_runner_rule_is_needed(served, dropped, refused):
    plan = _plan(**{"service_accounts.pipeline_namespace": "kubeflow"})
    _kfp_installed(served, "kubeflow", launcher_config=False)
    objects = rbac.render_rbac_objects(plan)
    for obj in objects:
        if obj["kind"] == "Role" and obj["metadata"]["name"].endswith("-kfp-runner"):
            obj["rules"] = [r for r in obj["rules"] if dropped not in r["resources"]]
    with pytest.raises(KfpPodFailed, match=refused):
        _run(served, plan, objects)


def test_gcs_root_with_pod_identity_needs_no_secret_rule(served):
    """``kfp_artifact_secrets: []`` (a gs:// root read as the pod's Workload Identity): no Secret is granted."""
    plan = _plan(**{"service_accounts.pipeline_namespace": "kubeflow", "service_accounts.kfp_artifact_secrets": []})
    replays = _run(served, plan, rbac.render_rbac_objects(plan))
    assert all(r[2] != "secrets" for replay in replays for r in replay.requests)
    assert not k8s.CoreV1Api(served.api(admin=True)).list_namespaced_secret("kubeflow").items
