"""Test support: replay, through the official client, the Kubernetes API requests KFP makes as the run's account.

On Kubeflow Pipelines every pod of a run's Argo Workflow runs as the run's
ServiceAccount (kubeflow/pipelines 2.17.0 ``backend/src/apiserver/template/template.go``
``setDefaultServiceAccount``), so besides the pipeline's own components three
programs call the API with its token, in the pods' namespace. Each request
below is the one the cited function makes (kubeflow/pipelines tag 2.17.0; the
Argo Workflows it pins, ``go.mod`` ``argo-workflows/v4 v4.0.5``), and a refusal
ends the way that function handles it:

1. KFP driver, root DAG (``backend/src/v2/driver/root_dag.go`` ``RootDAG`` ->
   ``backend/src/v2/config/env.go`` ``FromConfigMap``): GET ConfigMap
   ``kfp-launcher``. 404 means "use the defaults"; any other error, a 403
   included, is returned and the run fails at its first driver pod.
2. KFP launcher, in every component pod (``backend/src/v2/component/launcher_v2.go``
   ``Execute`` -> ``backend/src/v2/objectstore/object_store.go`` ``OpenBucket``):
   GET each artifact-store credentials Secret the pipeline root's provider
   names (``getS3BucketCredential`` / ``getGCSTokenClient``; none with
   ``fromEnv`` credentials). Any error fails the component before its command runs.
3. Argo executor, the ``wait`` container of every pod (argo-workflows v4.0.5
   ``workflow/executor/taskresult.go``): ``createTaskResult`` POSTs a
   WorkflowTaskResult named after the node ID (labels
   ``workflows.argoproj.io/workflow`` and ``workflows.argoproj.io/report-outputs-completed``,
   owner the Workflow); on AlreadyExists ``upsertTaskResult`` merge-patches it;
   ``ReportOutputs`` and ``patchTaskResultLabels`` merge-patch it again.
   ``reportResult`` retries a 403 without end ("failed to patch task result,
   see .../workflow-rbac/"): the step never completes. The replay stops at the
   first 403 and says so.

Not replayed (the pipeline does not trigger them; see
``multislice.render.rbac.KFP_RUNNER_REQUESTS``): the driver's PVC requests
(kfp-kubernetes PVC tasks), the importer's ConfigMap read, the launcher's
read of its own pod (only without ``KFP_RETRY_INDEX``, and a refusal is a
warning), Argo's artifact-repository secrets (mounted as a volume, no API
request), KFP's MLflow plugin's calls (to the MLflow server, which checks
the pod's token on ``mlflow.kubeflow.org`` ``experiments``; granted by rule,
``multislice.render.rbac.MLFLOW_PLUGIN_SOURCE``). Not modelled: the driver's and launcher's gRPC calls to MLMD and to
KFP's API server (not the Kubernetes API), Istio or NetworkPolicy between
them, and what the controller does with the task results.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from multislice.render.rbac import KFP_LAUNCHER_CONFIGMAP

ARGO_GROUP, ARGO_VERSION, TASK_RESULTS = "argoproj.io", "v1alpha1", "workflowtaskresults"
#: argo-workflows v4.0.5 ``workflow/common/common.go``: ``LabelKeyWorkflow``, ``LabelKeyReportOutputsCompleted``.
LABEL_WORKFLOW = "workflows.argoproj.io/workflow"
LABEL_REPORT_OUTPUTS_COMPLETED = "workflows.argoproj.io/report-outputs-completed"


class KfpPodFailed(AssertionError):
    """A request of KFP's pods was refused where KFP or Argo cannot go on; the message names it and the source."""


@dataclass
class Replay:
    """What one replayed KFP task asked and got.

    Attributes:
        requests: ``(component, verb, resource, name, HTTP status)`` in order.
        launcher_config: The ``kfp-launcher`` data the driver read; None: not found (KFP's defaults).
    """

    requests: list[tuple[str, str, str, str | None, int]] = field(default_factory=list)
    launcher_config: dict[str, str] | None = None


def _status(call) -> tuple[int, object]:
    try:
        return 200, call()
    except ApiException as error:
        return error.status, error


def _refused(component: str, what: str, error: object, source: str, consequence: str) -> KfpPodFailed:
    body = getattr(error, "body", "") or ""
    try:
        message = json.loads(body).get("message", body)
    except (ValueError, AttributeError):
        message = body
    return KfpPodFailed(f"{component}: {what} refused ({message}); {consequence} [{source}]")


def replay_task(
    api: k8s.ApiClient,
    namespace: str,
    *,
    workflow: str,
    workflow_uid: str,
    node_id: str,
    artifact_secrets: Sequence[str] = (),
    root_dag: bool = False,
) -> Replay:
    """Replay one KFP task pod's API requests as ``api``'s user, in ``namespace`` (the pod's).

    Args:
        api: An official ApiClient authenticated as the run's ServiceAccount.
        namespace: The namespace the run's pods are in (``service_accounts.pipeline_namespace``).
        workflow, workflow_uid: The Argo Workflow (the task result's owner and label).
        node_id: The Argo node ID: the WorkflowTaskResult's name.
        artifact_secrets: Secrets the pipeline root's provider names (KFP's default: ``mlpipeline-minio-artifact``).
        root_dag: Also replay the root DAG driver (the run's first pod).

    Raises:
        KfpPodFailed: a request was refused where the real program fails or never completes.
    """
    core, custom = k8s.CoreV1Api(api), k8s.CustomObjectsApi(api)
    replay = Replay()
    if root_dag:
        code, got = _status(lambda: core.read_namespaced_config_map(KFP_LAUNCHER_CONFIGMAP, namespace))
        replay.requests.append(("KFP driver", "get", "configmaps", KFP_LAUNCHER_CONFIGMAP, code))
        if code == 200:
            replay.launcher_config = dict(getattr(got, "data", None) or {})
        elif code != 404:  # env.go FromConfigMap: only IsNotFound is forgiven
            raise _refused(
                "KFP driver", f"get configmaps {KFP_LAUNCHER_CONFIGMAP!r} in {namespace!r}", got,
                "kubeflow/pipelines 2.17.0 backend/src/v2/config/env.go FromConfigMap",
                "the root DAG driver returns the error and the run fails at its first pod",
            )  # fmt: skip
    for secret in artifact_secrets:
        code, got = _status(lambda name=secret: core.read_namespaced_secret(name, namespace))
        replay.requests.append(("KFP launcher", "get", "secrets", secret, code))
        if code != 200:
            raise _refused(
                "KFP launcher", f"get secrets {secret!r} in {namespace!r}", got,
                "kubeflow/pipelines 2.17.0 backend/src/v2/objectstore/object_store.go OpenBucket",
                "the launcher cannot open the pipeline root and the component fails",
            )  # fmt: skip
    result = {
        "apiVersion": f"{ARGO_GROUP}/{ARGO_VERSION}",
        "kind": "WorkflowTaskResult",
        "metadata": {
            "name": node_id,
            "labels": {LABEL_WORKFLOW: workflow, LABEL_REPORT_OUTPUTS_COMPLETED: "false"},
            "ownerReferences": [
                {
                    "apiVersion": f"{ARGO_GROUP}/{ARGO_VERSION}",
                    "kind": "Workflow",
                    "name": workflow,
                    "uid": workflow_uid,
                }
            ],
        },
    }
    argo_source = "argo-workflows v4.0.5 workflow/executor/taskresult.go upsertTaskResult"
    never = "Argo's reportResult retries it without end: the step never completes"
    code, got = _status(
        lambda: custom.create_namespaced_custom_object(ARGO_GROUP, ARGO_VERSION, namespace, TASK_RESULTS, result)
    )
    replay.requests.append(("Argo executor", "create", TASK_RESULTS, None, code))
    if code not in (200, 201, 409):
        raise _refused("Argo executor", f"create {TASK_RESULTS} in {namespace!r}", got, argo_source, never)
    outputs = {"outputs": {"parameters": [], "artifacts": []}}
    labels = {"metadata": {"labels": {LABEL_REPORT_OUTPUTS_COMPLETED: "true"}}}
    for body in (outputs, labels):  # ReportOutputs, then patchTaskResultLabels
        code, got = _status(
            lambda body=body: custom.patch_namespaced_custom_object(
                ARGO_GROUP, ARGO_VERSION, namespace, TASK_RESULTS, node_id, body
            )
        )
        replay.requests.append(("Argo executor", "patch", TASK_RESULTS, node_id, code))
        if code != 200:
            raise _refused("Argo executor", f"patch {TASK_RESULTS} {node_id!r} in {namespace!r}", got, argo_source,
                           never)  # fmt: skip
    return replay
