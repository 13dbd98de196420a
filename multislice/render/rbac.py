"""RBAC for the GKE path: the ServiceAccounts, Roles and bindings the pipeline's pods need, and no more.

What each step does on the Kubernetes API, and so what the pipeline's
ServiceAccount (``service_accounts.pipeline``) is granted, in ``namespace`` only:

=================  =====================================  ===================================
API group          resources                              verbs (which step)
=================  =====================================  ===================================
jobset.x-k8s.io    jobsets                                create, get, list, watch (admit,
                                                          launch, train), delete (cleanup)
batch              jobs                                   create, get, list, watch (verifier
                                                          and export Jobs, preflight's
                                                          compiles), delete (cleanup)
"" (core)          pods                                   get, list, watch (launch, train:
                                                          an elastic stage's lost slice)
"" (core)          pods/log                               get (train: the leader's log;
                                                          verify_checkpoint, export: their
                                                          Job's, while it runs too)
"" (core)          events                                 get, list, watch (launch: why a pod waits)
kueue.x-k8s.io     workloads                              get, list, watch (admit)
kueue.x-k8s.io     localqueues (the run's queue only)     get, patch, create (provision:
                                                          server-side apply)
ray.io             rayjobs (launcher: ray; see below)     create, get, list, watch (admit,
                                                          launch, train), delete (cleanup)
resource.k8s.io    resourceclaimtemplates (idem)          create, get, list (admit), delete
                                                          (cleanup)
=================  =====================================  ===================================

The Ray rows are rendered for every profile, not only one with ``launcher: ray``: ``launcher`` is a run
parameter of the compiled pipeline (:func:`multislice.render.launchers.offered_kinds`), and a run that picks
``ray`` under RBAC rendered for JobSets only would get a 403 on ``rayjobs create`` at admit, after its node pools
were created. provision checks the rights of the run's own launchers first (:func:`required_access`, asked as
SelfSubjectAccessReviews by :func:`multislice.backends.gke.prerequisites.check_access`).

Server-side apply is a PATCH, authorized as ``patch``; when the object does
not exist yet the API server authorizes it a second time as ``create`` with
the object's name (``k8s.io/apiserver/pkg/endpoints/handlers/patch.go``,
``createAuthorizerAttributes``), so every applied object is granted
``get, patch, create`` by name (:data:`APPLY`).

The pipeline also gets ``coordination.k8s.io`` ``leases``: get, create, patch (admit, launch and
train renew their JobSet's Lease), list and delete (``multislice reap``, the
safety net of :mod:`multislice.backends.gke.lease`).

Cluster-wide, a ClusterRole grants only reads: ``customresourcedefinitions``
(get, list: provision checks the JobSet and Kueue CRDs are served) and
``nodes`` (get, list, watch: launch maps pods to node pools, train sees a
lost slice's nodes), the run's ClusterQueue by name (get: train, how many
slices of an elastic stage Kueue can admit) and, for Ray, the KubeRay TPU
webhook's MutatingWebhookConfiguration by name (get: provision checks it is
installed; ``admissionregistration.k8s.io``). The
cluster-scoped Kueue objects (ResourceFlavor, ClusterQueue,
WorkloadPriorityClass; with ``node_pools.queued_provisioning`` also the
ProvisioningRequestConfig and AdmissionCheck) are applied once by a cluster admin from
``multislice render``; with ``service_accounts.kueue_cluster_objects: true``
a second ClusterRole lets the pipeline get and server-side apply (patch)
exactly those objects, by name (create included, as above). With DRANET under
Kueue (a stage launched by Ray on node pools with additional networks), a Role
in Kueue's namespace (``kueue-system``) lets it get one ConfigMap, Kueue's
Configuration (``kueue-manager-config``), by name: provision checks its DRA
device class mappings.

On Kubeflow Pipelines the run's whole Argo Workflow runs as the run's
ServiceAccount (KFP's API server sets ``spec.serviceAccountName`` from the
run's ``service_account``, else ``pipeline-runner`` / multi-user
``default-editor``: kubeflow/pipelines 2.17.0 ``backend/src/apiserver/template/template.go``
``setDefaultServiceAccount``, ``backend/src/common/util/workflow.go``
``SetServiceAccount``), so KFP's driver and launcher and Argo's executor make
their own requests as ``service_accounts.pipeline``, in the namespace the run's
pods are in (``pipeline_namespace``). A second Role there,
``<pipeline>-kfp-runner`` (:func:`kfp_runner_rules`), bound to the
ServiceAccount only, grants exactly those (:data:`KFP_RUNNER_REQUESTS`), KFP's
MLflow plugin's included (``mlflow.kubeflow.org`` ``experiments``, checked by
MLflow against the pod's token). Why
not bind to KFP's own accounts instead: ``pipeline-runner``
(``manifests/kustomize/base/pipeline/pipeline-runner-role.yaml``: ``pods``,
``jobs``, ``deployments`` ``*``, every ``secrets`` get) and ``default-editor``
(the ``kubeflow-edit`` ClusterRole) are shared by every pipeline of the
namespace: binding the JobSet, Kueue and Lease rights to them would hand
those to every other pipeline, and theirs to this one.

The trainer's ServiceAccount (``service_accounts.trainer``) gets no Kubernetes
API rights and no mounted token; with ``trainer_gcp_service_account`` it
carries the Workload Identity annotation ``iam.gke.io/gcp-service-account``
(https://cloud.google.com/kubernetes-engine/docs/how-to/workload-identity).
The pipeline's components call the GKE API (node pools) as
``pipeline_gcp_service_account``: in the cluster through the same Workload
Identity annotation on the pipeline's ServiceAccount; on Vertex AI Pipelines
they run outside the cluster as that Google service account, which GKE
authenticates as a user named by its email, so it is also bound to the same
Role (and ClusterRole) as a ``User``
(https://cloud.google.com/kubernetes-engine/docs/how-to/role-based-access-control).

Sources: Kubernetes RBAC (https://kubernetes.io/docs/reference/access-authn-authz/rbac/),
JobSet and Kueue API groups from their CRDs (``multislice/crds``).
"""

from __future__ import annotations

from typing import Any

from multislice import names
from multislice.plan import Plan
from multislice.render import in_place, kueue, launchers, schema

RBAC_API = "rbac.authorization.k8s.io/v1"
#: Annotation linking a Kubernetes ServiceAccount to a Google service account (GKE Workload Identity).
WORKLOAD_IDENTITY_ANNOTATION = "iam.gke.io/gcp-service-account"
#: Verbs Kubernetes RBAC knows for resources (https://kubernetes.io/docs/reference/access-authn-authz/authorization/).
VERBS = frozenset({"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"})
_RULE_KEYS = frozenset({"apiGroups", "resources", "verbs", "resourceNames"})
_SUBJECT_KINDS = frozenset({"ServiceAccount", "User", "Group"})

READ = ["get", "list", "watch"]
#: What server-side apply of a named object needs: read it, patch it, and create it the first time (patch.go).
APPLY = ["get", "patch", "create"]


def _rule(group: str, resources: list[str], verbs: list[str], names_: list[str] | None = None) -> dict[str, Any]:
    rule: dict[str, Any] = {"apiGroups": [group], "resources": list(resources), "verbs": list(verbs)}
    if names_:
        rule["resourceNames"] = list(names_)
    return rule


def namespaced_rules(plan: Plan, offered: bool = True) -> list[dict[str, Any]]:
    """The pipeline Role's rules in the run's namespace (the table in the module docstring).

    ``offered``: with the rules of every launcher the compiled pipeline's run form offers (what is rendered);
    False: only those of the plan's own launchers (what this run's steps need: :func:`required_access`).
    """
    return [
        _rule("jobset.x-k8s.io", ["jobsets"], [*READ, "create", "delete"]),
        _rule("batch", ["jobs"], [*READ, "create", "delete"]),
        _rule("", ["pods"], READ),
        _rule("", ["pods/log"], ["get"]),
        _rule("", ["events"], READ),
        _rule("kueue.x-k8s.io", ["workloads"], READ),
        _rule("kueue.x-k8s.io", ["localqueues"], APPLY, [plan.spec.queue]),
        _rule("coordination.k8s.io", ["leases"], ["get", "list", "create", "patch", "delete"]),
        *launcher_rules(plan, offered),
    ]


#: KFP's MLflow plugin (kubeflow/pipelines 2.17.0, enabled by ``KFP_MLFLOW_CONFIG``, which KFP's API server injects
#: into the Workflow when a namespace or the server configures MLflow): the driver opens a nested MLflow run per task
#: (``backend/src/v2/common/plugins/mlflow/handler.go`` ``OnTaskStart``: ``runs/create``) and the driver or launcher
#: closes it (``OnTaskEnd``: ``runs/log-batch``, ``runs/update``), authenticated, with auth type ``kubernetes``, by the
#: pod's ServiceAccount token (``backend/src/common/plugins/mlflow/config.go`` ``ResolveMLflowCredentials``).
#: MLflow's Kubernetes authorization checks each call as an access review of that token on ``mlflow.kubeflow.org``
#: ``experiments`` in the run's namespace; KFP's own runner Role grants exactly these verbs for it
#: (``manifests/kustomize/base/pipeline/pipeline-runner-role.yaml``).
MLFLOW_GROUP = "mlflow.kubeflow.org"
MLFLOW_PLUGIN_SOURCE = (
    "backend/src/v2/common/plugins/mlflow/handler.go OnTaskStart (runs/create), OnTaskEnd (runs/log-batch, "
    "runs/update) as the pod's token; verbs of manifests/kustomize/base/pipeline/pipeline-runner-role.yaml"
)
MLFLOW_REFUSED = (
    "logged only (plugins/dispatcher.go): the task runs, but its MLflow run is never created or closed, and the "
    "run's MLflow tracking is silently incomplete"
)

#: The Kubernetes API requests KFP's pods make as the run's ServiceAccount, in the pods' namespace, and what a
#: refusal does: ``(component, verb, API group, resource, name, source, on Forbidden)``. Name None: any name (a
#: POST ``create`` carries none for RBAC). Read from kubeflow/pipelines 2.17.0 and the Argo Workflows it pins
#: (``go.mod``: argo-workflows/v4 v4.0.5). Not made by this pipeline, so not granted: the driver's PVC
#: create/get/delete (``backend/src/v2/driver/k8s.go``, kfp-kubernetes ``CreatePVC``/``DeletePVC`` tasks only),
#: the importer's ConfigMap read (no ``dsl.importer`` here), the launcher's read of its own pod for the retry
#: index (``launcher_v2.go`` ``retryIndexFromPodAnnotation``: only when ``KFP_RETRY_INDEX`` is unset, which
#: KFP 2.17's compiler sets, and a refusal is only a warning), Argo's artifact-repository secrets (the
#: executor reads them from a volume the controller mounts, ``workflow/executor/executor.go`` ``GetSecret``).
KFP_RUNNER_REQUESTS: tuple[tuple[str, str, str, str, str | None, str, str], ...] = (
    ("KFP driver (root DAG)", "get", "", "configmaps", "kfp-launcher",
     "backend/src/v2/driver/root_dag.go RootDAG -> backend/src/v2/config/env.go FromConfigMap",
     "fatal: only NotFound falls back to the defaults; the run fails at its first driver pod"),
    ("KFP launcher", "get", "", "secrets", "<kfp_artifact_secrets>",
     "backend/src/v2/component/launcher_v2.go Execute -> backend/src/v2/objectstore/object_store.go OpenBucket "
     "(getS3BucketCredential, getGCSTokenClient; not with fromEnv credentials)",
     "fatal: the component fails before its command runs"),
    ("Argo executor (wait)", "create", "argoproj.io", "workflowtaskresults", None,
     "workflow/executor/taskresult.go createTaskResult (name: the node ID)",
     "retried without end (reportResult): the step never completes"),
    ("Argo executor (wait)", "patch", "argoproj.io", "workflowtaskresults", "<node ID>",
     "workflow/executor/taskresult.go patchTaskResult, patchTaskResultLabels (merge patch)",
     "retried without end (reportResult): the step never completes"),
    *((f"KFP driver and launcher (MLflow plugin, {verb})", verb, MLFLOW_GROUP, "experiments", None,
       MLFLOW_PLUGIN_SOURCE, MLFLOW_REFUSED) for verb in ("get", "list", "create", "update")),
)  # fmt: skip

#: KFP's launcher ConfigMap (``backend/src/v2/config/env.go``, ``configMapName``).
KFP_LAUNCHER_CONFIGMAP = "kfp-launcher"


def kfp_runner_rules(plan: Plan) -> list[dict[str, Any]]:
    """What KFP's pods ask as ``service_accounts.pipeline`` in ``pipeline_namespace`` (:data:`KFP_RUNNER_REQUESTS`).

    Returns:
        Rules: ``configmaps`` get of ``kfp-launcher`` only; ``secrets`` get of ``service_accounts.kfp_artifact_secrets``
        only (no rule when empty); ``argoproj.io`` ``workflowtaskresults`` create and patch (not by name: a POST
        carries no name for RBAC, and the names are Argo's node IDs); ``mlflow.kubeflow.org`` ``experiments`` get,
        list, create, update (KFP's MLflow plugin, :data:`MLFLOW_GROUP`; harmless where no MLflow is installed:
        RBAC names a group whether or not it is served).
    """
    secrets = plan.spec.service_accounts.kfp_artifact_secrets
    rules = [_rule("", ["configmaps"], ["get"], [KFP_LAUNCHER_CONFIGMAP])]
    if secrets:
        rules.append(_rule("", ["secrets"], ["get"], list(secrets)))
    rules.append(_rule("argoproj.io", ["workflowtaskresults"], ["create", "patch"]))
    rules.append(_rule(MLFLOW_GROUP, ["experiments"], ["get", "list", "create", "update"]))
    return rules


def launcher_rules(plan: Plan, offered: bool = True) -> list[dict[str, Any]]:
    """What the launchers add besides the JobSet's rules (:meth:`.launchers.LauncherKind.rbac_rules`): for
    ``launcher: ray``, its RayJob and DRANET ResourceClaimTemplates.

    ``offered`` (the default, what is rendered): for every launcher a run of the compiled pipeline may pick
    (:func:`.launchers.offered_kinds`: ``launcher`` is a run parameter, so a profile's RBAC covers Ray even when the
    profile says ``jobset``); False: only the plan's own launchers.
    """
    kinds = launchers.offered_kinds(plan) if offered else launchers.kinds_of(plan)
    return [rule for kind in kinds for rule in kind.rbac_rules()]


def cluster_read_rules(plan: Plan | None = None, offered: bool = True) -> list[dict[str, Any]]:
    """The only cluster-wide rights of the pipeline: read CRDs and nodes, get the run's ClusterQueue by name
    (train, elastic stages: what Kueue can admit) and, for the launchers (``offered`` as in :func:`launcher_rules`),
    what provision reads to check their prerequisites (:meth:`.launchers.LauncherKind.cluster_rbac_rules`: for Ray,
    the KubeRay TPU webhook's MutatingWebhookConfiguration, by name)."""
    rules = [
        _rule("apiextensions.k8s.io", ["customresourcedefinitions"], ["get", "list"]),
        _rule("", ["nodes"], READ),
    ]
    if plan is not None:
        rules.append(_rule("kueue.x-k8s.io", ["clusterqueues"], ["get"], [plan.spec.cluster_queue]))
        kinds = launchers.offered_kinds(plan) if offered else launchers.kinds_of(plan)
        rules += [rule for kind in kinds for rule in kind.cluster_rbac_rules()]
    return rules


def required_access(plan: Plan) -> list[dict[str, str]]:
    """Every request this run's steps make, as SelfSubjectAccessReview ``resourceAttributes`` (``namespace``,
    ``verb``, ``group``, ``resource``, ``subresource``, ``name``; ``namespace`` '' for a cluster-scoped one), one per
    verb, resource and ``resourceNames`` entry of the rules the Role and ClusterRoles are rendered from, for the plan's
    own launchers only (:func:`namespaced_rules`, :func:`cluster_read_rules`, and :func:`kueue_cluster_rules` with
    ``service_accounts.kueue_cluster_objects``). Derived from the same functions, so the check and the render cannot
    drift. ``pods/log`` is resource ``pods``, subresource ``log``, as the API server's request info has it.
    """
    scoped = [(plan.spec.namespace, rule) for rule in namespaced_rules(plan, offered=False)]
    scoped += [("", rule) for rule in cluster_read_rules(plan, offered=False)]
    if plan.spec.service_accounts.kueue_cluster_objects:
        scoped += [("", rule) for rule in kueue_cluster_rules(plan)]
    found: list[dict[str, str]] = []
    for namespace, rule in scoped:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                plural, _, sub = resource.partition("/")
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames") or [""]:
                        attributes = {"namespace": namespace, "verb": verb, "group": group, "resource": plural,
                                      "subresource": sub, "name": name}  # fmt: skip
                        if attributes not in found:
                            found.append(attributes)
    return found


def kueue_cluster_rules(plan: Plan) -> list[dict[str, Any]]:
    """Get and server-side apply (patch, create) the run's cluster-scoped Kueue objects, by name only.

    With ``node_pools.queued_provisioning`` also its ProvisioningRequestConfig and AdmissionCheck
    (:func:`multislice.render.kueue.render_queued_provisioning`); without it, no right on them.
    """
    spec = plan.spec
    flavors = [spec.slice_type.flavor_name]
    if kueue.cpu_flavor_needed(plan):  # a stage launched by Ray: its head and submitter's flavor
        flavors.append(kueue.CPU_FLAVOR)
    rules = [
        _rule("kueue.x-k8s.io", ["resourceflavors"], APPLY, flavors),
        _rule("kueue.x-k8s.io", ["clusterqueues"], APPLY, [spec.cluster_queue]),
        _rule("kueue.x-k8s.io", ["workloadpriorityclasses"], APPLY, [spec.priority]),
    ]
    if spec.node_pools.queued_provisioning:
        rules += [
            _rule(
                "kueue.x-k8s.io", ["provisioningrequestconfigs"], APPLY,
                [kueue.provisioning_config_name(spec.cluster_queue)],
            ),
            _rule("kueue.x-k8s.io", ["admissionchecks"], APPLY, [kueue.admission_check_name(spec.cluster_queue)]),
        ]  # fmt: skip
    return rules


def kueue_config_rules() -> list[dict[str, Any]]:
    """Get Kueue's Configuration ConfigMap by name, in Kueue's namespace (provision checks its DRA device class
    mappings, :func:`multislice.render.kueue.kueue_configuration`); nothing else there."""
    return [_rule("", ["configmaps"], ["get"], [kueue.KUEUE_CONFIG_MAP])]


def _meta(name: str, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
    return meta


def render_rbac_objects(plan: Plan) -> list[dict[str, Any]]:
    """ServiceAccounts, the pipeline's Role and RoleBinding, and the cluster-read ClusterRole and binding.

    Returns:
        Plain objects in apply order: ServiceAccount (pipeline), ServiceAccount (trainer),
        Role, RoleBinding, ClusterRole, ClusterRoleBinding, the KFP runner Role and RoleBinding in
        ``pipeline_namespace`` (:func:`kfp_runner_rules`), then, with
        ``service_accounts.kueue_cluster_objects``, a second ClusterRole and binding, and with DRANET under Kueue
        (:func:`multislice.render.kueue.dra_mappings`) a Role and RoleBinding in Kueue's namespace
        (:func:`kueue_config_rules`).
        Each passes :func:`problems`.

    Raises:
        multislice.render.schema.ManifestInvalid: an object fails :func:`problems` (a renderer bug).
    """
    spec = plan.spec
    accounts = spec.service_accounts
    namespace = spec.namespace
    pipeline_ns = accounts.pipeline_namespace or namespace
    role = accounts.pipeline
    subjects: list[dict[str, Any]] = [{"kind": "ServiceAccount", "name": accounts.pipeline, "namespace": pipeline_ns}]
    if accounts.pipeline_gcp_service_account:
        subjects.append(
            {"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": accounts.pipeline_gcp_service_account}
        )
    pipeline_meta = _meta(accounts.pipeline, pipeline_ns)
    if accounts.pipeline_gcp_service_account:
        # In the cluster (KFP on GKE), the components reach the GKE API (node pools) as this Google account.
        pipeline_meta["annotations"] = {WORKLOAD_IDENTITY_ANNOTATION: accounts.pipeline_gcp_service_account}
    trainer_meta = _meta(accounts.trainer, namespace)
    if accounts.trainer_gcp_service_account:
        trainer_meta["annotations"] = {WORKLOAD_IDENTITY_ANNOTATION: accounts.trainer_gcp_service_account}
    # ClusterRoleBindings are cluster-wide: name them after the namespace and account they bind.
    cluster_read = f"{role}-cluster-read"
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": pipeline_meta},
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": trainer_meta,
            "automountServiceAccountToken": False,
        },
        {"apiVersion": RBAC_API, "kind": "Role", "metadata": _meta(role, namespace), "rules": namespaced_rules(plan)},
        {
            "apiVersion": RBAC_API,
            "kind": "RoleBinding",
            "metadata": _meta(role, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            "subjects": subjects,
        },
        {
            "apiVersion": RBAC_API,
            "kind": "ClusterRole",
            "metadata": _meta(cluster_read),
            "rules": cluster_read_rules(plan),
        },
        {
            "apiVersion": RBAC_API,
            "kind": "ClusterRoleBinding",
            "metadata": _meta(f"{cluster_read}-{pipeline_ns}"),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": cluster_read},
            "subjects": subjects,
        },
    ]
    kfp_runner = f"{role}-kfp-runner"
    objects += [
        {
            "apiVersion": RBAC_API,
            "kind": "Role",
            "metadata": _meta(kfp_runner, pipeline_ns),
            "rules": kfp_runner_rules(plan),
        },
        {
            "apiVersion": RBAC_API,
            "kind": "RoleBinding",
            "metadata": _meta(kfp_runner, pipeline_ns),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": kfp_runner},
            "subjects": subjects[:1],  # the ServiceAccount: KFP's pods run as it; Vertex AI runs no KFP driver
        },
    ]
    if accounts.kueue_cluster_objects:
        kueue_role = f"{role}-kueue-{spec.cluster_queue}"
        objects += [
            {
                "apiVersion": RBAC_API,
                "kind": "ClusterRole",
                "metadata": _meta(kueue_role),
                "rules": kueue_cluster_rules(plan),
            },
            {
                "apiVersion": RBAC_API,
                "kind": "ClusterRoleBinding",
                "metadata": _meta(f"{kueue_role}-{pipeline_ns}"),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": kueue_role},
                "subjects": subjects,
            },
        ]
    objects += in_place_restart_objects(plan)
    if kueue.dra_mappings(plan):
        config_role = f"{role}-kueue-config"
        objects += [
            {
                "apiVersion": RBAC_API,
                "kind": "Role",
                "metadata": _meta(config_role, kueue.KUEUE_CONFIG_NAMESPACE),
                "rules": kueue_config_rules(),
            },
            {
                "apiVersion": RBAC_API,
                "kind": "RoleBinding",
                "metadata": _meta(f"{config_role}-{pipeline_ns}", kueue.KUEUE_CONFIG_NAMESPACE),
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": config_role},
                "subjects": subjects,
            },
        ]
    for obj in objects:
        found = problems(obj)
        if found:
            raise schema.ManifestInvalid(obj, found)
    return objects


def in_place_restart_objects(plan: Plan) -> list[dict[str, Any]]:
    """What JobSet's in-place restart agent needs as the training pods' ServiceAccount
    (``service_accounts.trainer``), unless ``restart_strategy: recreate``: a Role in the run's namespace that may
    ``patch`` pods and ``get, list, watch`` JobSets (:func:`multislice.render.in_place.agent_rules`), its RoleBinding,
    and a ValidatingAdmissionPolicy with its binding that lets that account change nothing of a pod but the in-place
    restart attempt annotation (:func:`multislice.render.in_place.admission_policy`; cluster-scoped, named after the
    namespace and account). Only the agent's container mounts the account's token
    (:func:`multislice.render.in_place.token_volume`). Rendered also when provision falls back to Recreate: the RBAC
    is applied once, before any run, for what a run may choose."""
    spec = plan.spec
    if spec.restart_strategy == "recreate" or not any(launchers.kind_of(s).name == "jobset" for s in plan.stages):
        return []
    account, namespace = spec.service_accounts.trainer, spec.namespace
    name = f"{account}-in-place-restart"
    return [
        {"apiVersion": RBAC_API, "kind": "Role", "metadata": _meta(name, namespace), "rules": in_place.agent_rules()},
        {
            "apiVersion": RBAC_API,
            "kind": "RoleBinding",
            "metadata": _meta(name, namespace),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}],
        },
        *in_place.admission_policy(namespace, account, f"{name}-{namespace}"),
    ]


def problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject a rendered ServiceAccount or RBAC object; empty when valid.

    Built-in kinds have no CRD in ``multislice/crds``: ObjectMeta is checked by
    :func:`multislice.render.schema.builtin_problems` (name, namespace scope, labels,
    annotations) and the RBAC fields here, as ``rbac.authorization.k8s.io/v1``
    defines them (rules: apiGroups, resources, verbs, resourceNames; roleRef; subjects).
    """
    found = schema.builtin_problems(obj)
    kind = obj.get("kind", "")
    allowed = {
        "ServiceAccount": {"apiVersion", "kind", "metadata", "automountServiceAccountToken"},
        "Role": {"apiVersion", "kind", "metadata", "rules"},
        "ClusterRole": {"apiVersion", "kind", "metadata", "rules"},
        "RoleBinding": {"apiVersion", "kind", "metadata", "roleRef", "subjects"},
        "ClusterRoleBinding": {"apiVersion", "kind", "metadata", "roleRef", "subjects"},
        "ValidatingAdmissionPolicy": {"apiVersion", "kind", "metadata", "spec"},
        "ValidatingAdmissionPolicyBinding": {"apiVersion", "kind", "metadata", "spec"},
    }[kind]
    if kind.startswith("ValidatingAdmissionPolicy"):
        return found + _policy_problems(obj)
    found += [f"{key}: unknown field of {kind}" for key in sorted(set(obj) - allowed)]
    for i, rule in enumerate(obj.get("rules", [])):
        where = f"rules[{i}]"
        found += [f"{where}.{key}: unknown field" for key in sorted(set(rule) - _RULE_KEYS)]
        if not rule.get("verbs") or set(rule["verbs"]) - VERBS:
            found.append(f"{where}.verbs: {rule.get('verbs')!r}; use verbs from {sorted(VERBS)}")
        if "*" in rule.get("resources", []) or "*" in rule.get("apiGroups", []) or not rule.get("resources"):
            found.append(f"{where}: name resources and API groups explicitly (no '*')")
        if "apiGroups" not in rule:
            found.append(f"{where}.apiGroups: required for resource rules")
    if kind in ("RoleBinding", "ClusterRoleBinding"):
        ref = obj.get("roleRef", {})
        if ref.get("apiGroup") != "rbac.authorization.k8s.io" or not ref.get("name"):
            found.append("roleRef: needs apiGroup rbac.authorization.k8s.io, kind and name")
        if kind == "ClusterRoleBinding" and ref.get("kind") != "ClusterRole":
            found.append("roleRef.kind: a ClusterRoleBinding can only refer to a ClusterRole")
        for j, subject in enumerate(obj.get("subjects", [])):
            if subject.get("kind") not in _SUBJECT_KINDS:
                found.append(f"subjects[{j}].kind: {subject.get('kind')!r} is not one of {sorted(_SUBJECT_KINDS)}")
            if subject.get("kind") == "ServiceAccount" and not subject.get("namespace"):
                found.append(f"subjects[{j}].namespace: a ServiceAccount subject needs its namespace")
    return found


#: The fields of ``admissionregistration.k8s.io/v1`` ValidatingAdmissionPolicy and binding specs this project renders.
_POLICY_SPEC_KEYS = {
    "ValidatingAdmissionPolicy": {"failurePolicy", "matchConstraints", "matchConditions", "variables", "validations",
                                  "paramKind", "auditAnnotations"},
    "ValidatingAdmissionPolicyBinding": {"policyName", "validationActions", "paramRef", "matchResources"},
}  # fmt: skip


def _policy_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject a rendered ValidatingAdmissionPolicy or binding: unknown spec fields, a policy
    without validations or with an unknown failure policy, a binding without its policy or a known action
    (``pkg/apis/admissionregistration/validation/validation.go``). The CEL expressions are not compiled here."""
    kind, spec = obj["kind"], obj.get("spec", {})
    found = [f"spec.{key}: unknown field of {kind}" for key in sorted(set(spec) - _POLICY_SPEC_KEYS[kind])]
    if kind == "ValidatingAdmissionPolicy":
        if spec.get("failurePolicy", "Fail") not in ("Fail", "Ignore"):
            found.append("spec.failurePolicy: Fail or Ignore")
        if not spec.get("validations") and not spec.get("auditAnnotations"):
            found.append("spec.validations: at least one validation or audit annotation")
        found += [f"spec.validations[{i}].expression: required" for i, v in enumerate(spec.get("validations", []))
                  if not v.get("expression")]  # fmt: skip
    else:
        if not spec.get("policyName"):
            found.append("spec.policyName: required")
        if not spec.get("validationActions") or set(spec["validationActions"]) - {"Deny", "Warn", "Audit"}:
            found.append("spec.validationActions: one or more of Deny, Warn, Audit")
    return found
