"""What the cluster must serve before a run's objects go in: the JobSet and Kueue CRDs; applying Kueue objects.

CRDs are read as ``apiextensions.k8s.io/v1`` CustomResourceDefinitions
(``spec.versions[].served``; condition ``Established``), which needs only
``get`` on ``customresourcedefinitions`` (cluster-wide, read-only). The
versions this project renders: JobSet ``v1alpha2`` (JobSet v0.12.0) and Kueue
``v1beta2`` (Kueue v0.19, https://kueue.sigs.k8s.io/docs/reference/kueue.v1beta2/).

Kueue objects are applied with server-side apply
(https://kubernetes.io/docs/reference/using-api/server-side-apply/): a PATCH
with ``Content-Type: application/apply-patch+yaml``, ``fieldManager`` fixed
to :data:`.client.FIELD_MANAGER` and ``force=true``, so re-applying the same
objects is a no-op and a field another manager set is taken over rather than
failing the run.

With DRANET under Kueue (:func:`multislice.render.kueue.dra_mappings`), Kueue's own Configuration must map
DRANET's DeviceClass to the resource the ClusterQueue has quota for: :func:`check_kueue_configuration` reads it
from Kueue's ConfigMap (``kueue-system/kueue-manager-config``, by name:
:func:`multislice.render.rbac.kueue_config_rules`).
"""

from __future__ import annotations

import json
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

from multislice.backends.gke.client import FIELD_MANAGER, JOBSET_GROUP, JOBSET_VERSION, KUEUE_GROUP, KUEUE_VERSION, Kube
from multislice.errors import InputError
from multislice.plan import Plan
from multislice.render import kueue

#: CRD name -> the version this project needs served.
REQUIRED_CRDS: dict[str, str] = {
    f"jobsets.{JOBSET_GROUP}": JOBSET_VERSION,
    f"workloads.{KUEUE_GROUP}": KUEUE_VERSION,
    f"clusterqueues.{KUEUE_GROUP}": KUEUE_VERSION,
    f"localqueues.{KUEUE_GROUP}": KUEUE_VERSION,
    f"resourceflavors.{KUEUE_GROUP}": KUEUE_VERSION,
    f"workloadpriorityclasses.{KUEUE_GROUP}": KUEUE_VERSION,
}
INSTALL_HINT = {
    JOBSET_GROUP: "install JobSet v0.12.0 or later (https://jobset.sigs.k8s.io/docs/installation/)",
    KUEUE_GROUP: "install Kueue v0.19 or later, which serves v1beta2 (https://kueue.sigs.k8s.io/docs/installation/)",
    "ray.io": "enable GKE's Ray operator add-on, which installs KubeRay "
    "(https://cloud.google.com/kubernetes-engine/docs/add-on/ray-on-gke/how-to/enable-ray-on-gke), or install "
    "KubeRay v1.7.0 yourself",
}
#: Kind -> (plural, namespaced) of the Kueue objects :mod:`multislice.render.kueue` renders.
KUEUE_RESOURCES: dict[str, tuple[str, bool]] = {
    "ResourceFlavor": ("resourceflavors", False),
    "ClusterQueue": ("clusterqueues", False),
    "WorkloadPriorityClass": ("workloadpriorityclasses", False),
    "LocalQueue": ("localqueues", True),
    "ProvisioningRequestConfig": ("provisioningrequestconfigs", False),
    "AdmissionCheck": ("admissionchecks", False),
}


class CrdsMissing(InputError):
    """A CRD the run needs is not installed or does not serve the needed version; the message says what to install."""


class KueueMisconfigured(InputError):
    """Kueue's Configuration lacks what the run's workloads need (a DRA device class mapping): Kueue would never
    admit them; the message says what to merge."""


def check_kueue_configuration(kube: Kube, plan: Plan) -> str | None:
    """Check that Kueue's Configuration maps each DeviceClass the plan claims (:func:`.kueue.dra_mappings`) to the
    resource the rendered ClusterQueue has quota for, and that its ``featureGates`` do not turn Kueue's DRA
    integration off; returns a line saying what was checked (None when the plan claims no DRA devices).

    Source: Kueue v0.19.2 ``pkg/dra/claims.go`` (an unmapped DeviceClass makes the Workload inadmissible),
    ``pkg/controller/core/workload_controller.go`` (with ``KueueDRAIntegration`` off, a Workload with DRA claims
    is rejected), ``apis/config/v1beta2/configuration_types.go`` (``resources.deviceClassMappings``,
    ``featureGates``). Not seen: feature gates given on the manager's command line (``--feature-gates``) and a
    ConfigMap changed since Kueue's manager started (it reads the file at start).

    Raises:
        KueueMisconfigured: the mapping is missing or names another resource, or ``KueueDRAIntegration`` is off.
        multislice.errors.InputError: the pipeline may not read the ConfigMap (403).
    """
    mappings = kueue.dra_mappings(plan, offered=False)  # this run's launchers: a JobSet run needs no mapping
    if not mappings:
        return None
    where = f"ConfigMap {kueue.KUEUE_CONFIG_NAMESPACE}/{kueue.KUEUE_CONFIG_MAP}"
    merge = (
        f"merge kueue-config/{kueue.KUEUE_CONFIG_KEY} from `multislice render` into {where} (key "
        f"{kueue.KUEUE_CONFIG_KEY}, resources.deviceClassMappings), restart Kueue (kubectl -n "
        f"{kueue.KUEUE_CONFIG_NAMESPACE} rollout restart deployment kueue-controller-manager) and apply the rendered "
        "ClusterQueue; or drop node_pools.additional_node_networks"
    )
    try:
        found = kube.call(
            kube.core.read_namespaced_config_map, kueue.KUEUE_CONFIG_MAP, kueue.KUEUE_CONFIG_NAMESPACE,
            what=f"get {where}",
        )  # fmt: skip
    except ApiException as error:
        if error.status == 404:
            return (
                f"{where} not found (Kueue installed under another name?): its DRA device class mappings are not "
                f"checked; Kueue needs {', '.join(f'{c} -> {r}' for c, r in mappings.items())} ({merge})"
            )
        if error.status == 403:
            raise InputError(
                f"the pipeline may not read Kueue's Configuration ({where}) to check its DRA device class mappings",
                "apply the RBAC `multislice render` writes (rbac-role-*-kueue-config.yaml and its RoleBinding)",
            ) from None
        raise
    text = (found.data or {}).get(kueue.KUEUE_CONFIG_KEY) or ""
    try:
        configuration = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise KueueMisconfigured(f"{where} key {kueue.KUEUE_CONFIG_KEY} is not YAML: {error}", merge) from None
    if (configuration.get("featureGates") or {}).get(kueue.DRA_FEATURE_GATE) is False:
        raise KueueMisconfigured(
            f"Kueue's Configuration ({where}) sets featureGates.{kueue.DRA_FEATURE_GATE}: false: Kueue rejects the "
            "RayJob's Workload (Workload uses DRA resources but the KueueDRAIntegration feature gate is not enabled)",
            "remove that feature gate override and restart Kueue; or drop node_pools.additional_node_networks",
        )
    entries = ((configuration.get("resources") or {}).get("deviceClassMappings")) or []
    for device_class, resource in mappings.items():
        mapped = [e.get("name") for e in entries if device_class in (e.get("deviceClassNames") or [])]
        if not mapped:
            raise KueueMisconfigured(
                f"Kueue's Configuration ({where}) maps no resource to DeviceClass {device_class}, which the Ray "
                f"workers' DRANET claims use: Kueue would mark the RayJob's Workload inadmissible (DeviceClass "
                f"{device_class} is not mapped in DRA configuration)",
                merge,
            )
        if resource not in mapped:
            raise KueueMisconfigured(
                f"Kueue's Configuration ({where}) maps DeviceClass {device_class} to {', '.join(map(str, mapped))}; "
                f"the rendered ClusterQueue has quota for {resource}: Kueue would leave the RayJob pending "
                f"(resource {mapped[0]} unavailable in ClusterQueue)",
                f"map {device_class} to {resource} in {where} and restart Kueue, or give ClusterQueue "
                f"{plan.spec.cluster_queue} quota for {mapped[0]}",
            )
    return f"Kueue maps {', '.join(f'DeviceClass {c} to {r}' for c, r in mappings.items())} ({where})"


def read_crd(kube: Kube, name: str) -> dict[str, Any] | None:
    """The CustomResourceDefinition ``name`` as raw JSON (the client's models would parse its whole OpenAPI schema
    for nothing), or None when it is not installed.

    Raises:
        multislice.backends.gke.retry.ApiUnavailable: the API kept failing.
    """
    try:
        response = kube.call(
            kube.crds.read_custom_resource_definition, name, _preload_content=False, what=f"get CRD {name}"
        )
    except ApiException as error:
        if error.status != 404:
            raise
        return None
    return json.loads(response.data)


def served_versions(kube: Kube, required: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The served versions of each required CRD (``required``, default :data:`REQUIRED_CRDS`; empty list: not
    installed or not established).

    Raises:
        multislice.backends.gke.retry.ApiUnavailable: the API kept failing.
    """
    found: dict[str, list[str]] = {}
    for name in required or REQUIRED_CRDS:
        crd = read_crd(kube, name)
        if crd is None:
            found[name] = []
            continue
        conditions = {c.get("type"): c.get("status") for c in crd.get("status", {}).get("conditions") or []}
        established = conditions.get("Established", "True") == "True"
        found[name] = [v["name"] for v in crd["spec"]["versions"] if v.get("served")] if established else []
    return found


def check_crds(kube: Kube, extra: dict[str, str] | None = None) -> dict[str, list[str]]:
    """Check the JobSet and Kueue CRDs, and ``extra`` (CRD name -> version: what the plan's launchers need besides,
    :attr:`multislice.backends.launcher.Launcher.crds`, e.g. KubeRay's RayJob), are served at the versions this
    project uses.

    Returns:
        CRD name -> served versions, e.g. ``{"jobsets.jobset.x-k8s.io": ["v1alpha2"], ...}``.

    Raises:
        CrdsMissing: naming each missing CRD or version, what is served instead, and what to install.
    """
    required = {**REQUIRED_CRDS, **(extra or {})}
    found = served_versions(kube, required)
    problems, hints = [], []
    for name, needed in required.items():
        if needed not in found[name]:
            group = name.split(".", 1)[1]
            served = ", ".join(found[name]) or "nothing (not installed)"
            problems.append(f"{name} needs {needed}, the cluster serves {served}")
            if INSTALL_HINT[group] not in hints:
                hints.append(INSTALL_HINT[group])
    if problems:
        raise CrdsMissing("; ".join(problems) + "; " + "; ".join(hints))
    return found


def object_path(obj: dict[str, Any], namespace: str) -> str:
    """The API path of a Kueue object (``/apis/kueue.x-k8s.io/v1beta2/[namespaces/NS/]PLURAL/NAME``).

    Raises:
        KeyError: a kind not in :data:`KUEUE_RESOURCES`.
    """
    plural, namespaced = KUEUE_RESOURCES[obj["kind"]]
    where = f"namespaces/{obj['metadata'].get('namespace', namespace)}/" if namespaced else ""
    return f"/apis/{obj['apiVersion']}/{where}{plural}/{obj['metadata']['name']}"


def server_side_apply(kube: Kube, obj: dict[str, Any]) -> dict[str, Any]:
    """Server-side apply one object with the fixed field manager; returns the object as stored.

    Raises:
        kubernetes.client.exceptions.ApiException: the API refused it (e.g. 422 invalid, 403 forbidden).
    """
    path = object_path(obj, kube.namespace)
    return kube.call(
        kube.api.call_api, path, "PATCH",
        query_params=[("fieldManager", FIELD_MANAGER), ("force", "true")],
        header_params={"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
        body=obj, response_type="object", auth_settings=["BearerToken"], _return_http_data_only=True,
        what=f"apply {obj['kind']} {obj['metadata']['name']}",
    )  # fmt: skip
