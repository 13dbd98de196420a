"""What provision checks on the cluster before it asks for any node pool: the pipeline's own rights, and what a
launcher needs installed besides its CRDs (for Ray: the KubeRay TPU webhook or GKE's Ray Operator add-on).

Both fail fast with a :class:`multislice.errors.InputError` naming what is missing and how to get it, before a TPU
node pool is created (:meth:`multislice.backends.gke.GkeBackend.provision`).

**The pipeline's rights** (:func:`check_access`). ``launcher`` is a run parameter of the compiled pipeline, while the
RBAC a cluster admin applied came from some earlier ``multislice render``: a run that picks ``ray`` on a cluster set
up for JobSets only would get a 403 on ``rayjobs create`` at admit, after its node pools were created. So provision
asks the API server, with one ``SelfSubjectAccessReview`` (``authorization.k8s.io/v1``) per request, whether the
caller may make every request this run's steps will make: :func:`multislice.render.rbac.required_access`, derived from
the rules the Role and ClusterRoles are rendered from, so the check cannot drift from the render. The API server
answers for the caller itself (``pkg/registry/authorization/selfsubjectaccessreview/rest.go``: the user of the
request, ``status.allowed`` when the authorizer's decision is Allow, ``status.reason`` its reason); every
authenticated user may create one (the default ClusterRole ``system:basic-user``). Done in provision, not plan:
the plan step does not talk to the cluster (it validates the profile and renders manifests offline, and
``multislice plan`` works with no cluster at all), and every step, provision included, runs as the same
ServiceAccount (KFP) or Google service account (Vertex AI), so provision's answer is the later steps'.

**The KubeRay TPU webhook** (:func:`check_tpu_webhook`). KubeRay v1.7.0 does not set ``TPU_WORKER_HOSTNAMES``,
``TPU_WORKER_ID`` or ``TPU_NAME`` on multi-host TPU worker pods; the KubeRay TPU webhook does, with the per-slice
pod affinity (GoogleCloudPlatform/ai-on-gke, ``ray-on-gke/tpu/kuberay-tpu-webhook``, now
ai-on-gke/kuberay-tpu-webhook), as does GKE's Ray Operator add-on. Without either, JAX on the workers cannot form
its slices. Accepted as installed:

- the MutatingWebhookConfiguration ``kuberay-tpu-mutating-webhook-cfg`` (the fixed name of both the webhook's
  ``deployments/mutating-webhook-cfg.yaml`` and its Helm chart) with a webhook whose rules mutate pod CREATE
  (``operations: [CREATE]``, ``apiGroups: [""]``, ``resources: [pods]``), read with ``get`` by name only; or
- the cluster's ``addonsConfig.rayOperatorConfig.enabled`` from the GKE API
  (:func:`multislice.backends.gke.nodepool.ray_operator_enabled`), asked only when the first is absent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from multislice.backends.gke.client import Kube
from multislice.errors import InputError
from multislice.plan import Plan
from multislice.render import launchers, rbac

#: How to install the KubeRay TPU webhook, or enable the add-on that brings it.
TPU_WEBHOOK_FIX = (
    "enable GKE's Ray Operator add-on (`gcloud container clusters update CLUSTER --location LOCATION "
    "--update-addons=RayOperator=ENABLED`, "
    "https://cloud.google.com/kubernetes-engine/docs/add-on/ray-on-gke/how-to/enable-ray-on-gke), or install the "
    "KubeRay TPU webhook with its Helm chart (https://github.com/ai-on-gke/kuberay-tpu-webhook; it needs "
    "cert-manager), which creates the MutatingWebhookConfiguration "
    f"{launchers.TPU_WEBHOOK_CONFIGURATION}; see docs/gke-setup.md"
)


class AccessMissing(InputError):
    """The pipeline's identity lacks rights the run's steps need; the message names each, the fix the RBAC to apply."""


class PrerequisiteMissing(InputError):
    """Something a launcher needs on the cluster besides its CRDs is not installed; the fix says how to install it."""


def _describe(attributes: dict[str, str]) -> str:
    """``rayjobs.ray.io in namespace "default"`` for one request's attributes (all but the verb)."""
    resource = attributes["resource"] + (f"/{attributes['subresource']}" if attributes["subresource"] else "")
    target = f"{resource}.{attributes['group']}" if attributes["group"] else resource
    if attributes["name"]:
        target += f' "{attributes["name"]}"'
    scope = f'in namespace "{attributes["namespace"]}"' if attributes["namespace"] else "cluster-wide"
    return f"{target} {scope}"


def check_access(kube: Kube, plan: Plan) -> int:
    """Ask the API server whether the caller may make each request the run's steps make
    (:func:`multislice.render.rbac.required_access`), one SelfSubjectAccessReview each.

    Returns:
        How many requests were reviewed (all allowed).

    Raises:
        AccessMissing: naming every request refused (and the API server's reason when it gives one), and the fix:
            apply the RBAC ``multislice render`` writes for this profile (which covers every launcher the run form
            offers).
        multislice.backends.gke.retry.ApiUnavailable: the API kept failing.
    """
    api = k8s.AuthorizationV1Api(kube.api)
    needed = rbac.required_access(plan)
    refused: dict[str, list[str]] = {}  # what (resource, name, scope) -> verbs refused, reasons
    for attributes in needed:
        review = k8s.V1SelfSubjectAccessReview(
            spec=k8s.V1SelfSubjectAccessReviewSpec(
                resource_attributes=k8s.V1ResourceAttributes(**{k: v or None for k, v in attributes.items()})
            )
        )
        what = f"review {attributes['verb']} {_describe(attributes)}"
        answer = kube.call(api.create_self_subject_access_review, review, what=what)
        status = answer.status
        if not (status and status.allowed):
            why = f" ({status.reason})" if status and status.reason else ""
            refused.setdefault(_describe(attributes), []).append(attributes["verb"] + why)
    if refused:
        accounts = plan.spec.service_accounts
        launchers_ = ", ".join(kind.name for kind in launchers.kinds_of(plan))
        raise AccessMissing(
            f"the pipeline may not make {sum(map(len, refused.values()))} of the {len(needed)} requests this run's "
            f"steps make (launcher {launchers_}); nothing was created. Missing: "
            + "; ".join(f"{', '.join(verbs)} {what}" for what, verbs in refused.items()),
            f"apply the RBAC `multislice render` writes for this profile (rbac-*.yaml: Role and ClusterRoles of "
            f"ServiceAccount {accounts.pipeline}, which cover every launcher the run form offers), as a cluster admin: "
            "kubectl apply -f <render dir>/rbac-*.yaml; see docs/gke-setup.md",
        )
    return len(needed)


def _mutates_pod_create(configuration: dict[str, Any]) -> bool:
    """Whether a MutatingWebhookConfiguration has a webhook whose rules take pod CREATE in the core group."""
    for webhook in configuration.get("webhooks") or []:
        for rule in webhook.get("rules") or []:
            operations = rule.get("operations") or []
            if (
                ("CREATE" in operations or "*" in operations)
                and set(rule.get("apiGroups") or []) & {"", "*"}
                and set(rule.get("resources") or []) & {"pods", "*"}
            ):
                return True
    return False


def check_tpu_webhook(kube: Kube, plan: Plan, addon_enabled: Callable[[Plan], bool]) -> str:
    """Check that something injects the TPU worker environment into KubeRay's TPU pods (the module docstring).

    Args:
        addon_enabled: Whether GKE's Ray Operator add-on is enabled on the plan's cluster
            (:func:`multislice.backends.gke.nodepool.ray_operator_enabled`); called only when the webhook's
            configuration is absent.

    Returns:
        One line saying which was found.

    Raises:
        PrerequisiteMissing: neither is there (or the configuration does not mutate pod creation); the fix says how
            to install one.
        multislice.backends.gke.nodepool.NodePoolError: the GKE API refused to read the cluster.
    """
    name = launchers.TPU_WEBHOOK_CONFIGURATION
    api = k8s.AdmissionregistrationV1Api(kube.api)
    try:
        response = kube.call(
            api.read_mutating_webhook_configuration, name, _preload_content=False,
            what=f"get MutatingWebhookConfiguration {name}",
        )  # fmt: skip
    except ApiException as error:
        if error.status != 404:
            raise
        response = None
    if response is not None:
        configuration = json.loads(response.data)
        if _mutates_pod_create(configuration):
            return f"KubeRay TPU webhook: MutatingWebhookConfiguration {name} mutates pod creation"
        raise PrerequisiteMissing(
            f"MutatingWebhookConfiguration {name} exists but none of its webhooks mutates pod CREATE, so the Ray TPU "
            "workers would get no TPU_WORKER_HOSTNAMES, TPU_WORKER_ID or TPU_NAME",
            "reinstall the KubeRay TPU webhook from its Helm chart, or " + TPU_WEBHOOK_FIX,
        )
    if addon_enabled(plan):
        return "KubeRay TPU webhook: GKE's Ray Operator add-on is enabled on the cluster"
    stages = ", ".join(s.name for s in plan.stages if launchers.kind_of(s).name == "ray")
    raise PrerequisiteMissing(
        f"stage(s) {stages} are launched by Ray on TPU, but the cluster has neither the KubeRay TPU webhook "
        f"(no MutatingWebhookConfiguration {name}) nor GKE's Ray Operator add-on: KubeRay itself does not set "
        "TPU_WORKER_HOSTNAMES, TPU_WORKER_ID or TPU_NAME on the TPU worker pods, so JAX could not form the slices; "
        "nothing was created",
        TPU_WEBHOOK_FIX,
    )
