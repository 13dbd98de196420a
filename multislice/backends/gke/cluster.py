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
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from multislice.backends.gke.client import FIELD_MANAGER, JOBSET_GROUP, JOBSET_VERSION, KUEUE_GROUP, KUEUE_VERSION, Kube
from multislice.errors import InputError

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


def served_versions(kube: Kube, required: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The served versions of each required CRD (``required``, default :data:`REQUIRED_CRDS`; empty list: not
    installed or not established).

    Raises:
        multislice.backends.gke.retry.ApiUnavailable: the API kept failing.
    """
    found: dict[str, list[str]] = {}
    for name in required or REQUIRED_CRDS:
        try:
            # Raw JSON: the client's models would parse every CRD's whole OpenAPI schema for nothing.
            response = kube.call(
                kube.crds.read_custom_resource_definition, name, _preload_content=False, what=f"get CRD {name}"
            )
        except ApiException as error:
            if error.status != 404:
                raise
            found[name] = []
            continue
        crd = json.loads(response.data)
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
