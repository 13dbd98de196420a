"""Whether the cluster's KubeRay is the one the Ray launcher renders for (KubeRay v1.7.0), read from its CRDs.

GKE's Ray Operator add-on (``--addons=RayOperator``) installs and runs KubeRay itself; which KubeRay follows the
cluster's GKE version, not this project, and may be older than v1.7.0. A KubeRay installed with Helm can be old the
same way: ``helm upgrade`` does not upgrade the CRDs a chart ships in ``crds/``. The RayJob's CRD served ``v1``
either way, so :func:`multislice.backends.gke.cluster.check_crds` passes, and nothing else would notice before the
run: a ``create`` without ``fieldValidation`` (this project's, :func:`.rayjob.create_or_adopt`) is answered 201 with
every field the served schema does not declare dropped (structural pruning, Kubernetes
``staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/pruning/algorithm.go``; field validation
``Warn``, the default, only adds a warning header). Without ``numOfHosts`` KubeRay makes one host per slice; without
``backoffLimit`` or a pod's ``resourceClaims[].resourceClaimTemplateName`` the RayJob would run, but not as rendered.

So :func:`check_kuberay`, before provision creates anything, reads the ``rayjobs.ray.io`` and ``rayclusters.ray.io``
CustomResourceDefinitions (``get`` on ``customresourcedefinitions``, the read the pipeline's ClusterRole already
grants: :func:`multislice.render.rbac.cluster_read_rules`) and walks each rendered RayJob against the served ``v1``
``openAPIV3Schema`` as the API server prunes and validates (:func:`schema_gaps`): a field the schema does not
declare, a value outside an ``enum``, a required field not rendered. KubeRay copies ``spec.rayClusterSpec`` into
the RayCluster it creates, so that part is walked against ``rayclusters.ray.io``'s ``spec`` too.

The fields the project renders are not all it relies on: KubeRay's behaviour changes between releases without a
field of ours changing (the ``ray.io/worker-group-replica-index`` and ``ray.io/replica-host-index`` pod labels
:mod:`.rayjob` finds the slices by: v1.5.0; the ``/api/healthz`` probes for ``rayVersion`` >= 2.53: v1.6.0;
``ray-operator/controllers/ray/utils/constant.go`` and ``common/pod.go`` at those tags). So the CRDs must also
declare the field that marks KubeRay v1.7.0 (:data:`RELEASE_FIELDS`, :data:`REQUIRED_RELEASE`): each marker is a
field KubeRay has kept from the release that added it to v1.7.0 (a later release that dropped one would be refused,
naming it; ``ray.io/v1`` fields have been removed only behind feature gates, as ``spec.deletionPolicy`` in v1.5.0).
The same table names the newest release whose fields the CRD has,
since KubeRay's CRDs carry no version: neither ``ray-operator/config/crd/bases/`` nor the Helm chart's ``crds/``
(v1.7.0: only ``controller-gen.kubebuilder.io/version``); an ``app.kubernetes.io/version`` label or annotation is
reported when an installer added one.
"""

from __future__ import annotations

from typing import Any

from multislice.backends.gke import cluster
from multislice.backends.gke.client import Kube
from multislice.backends.gke.prerequisites import PrerequisiteMissing

RAYJOBS_CRD, RAYCLUSTERS_CRD = "rayjobs.ray.io", "rayclusters.ray.io"
#: The served version the project renders (``ray.io/v1``).
SERVED_VERSION = "v1"
#: The KubeRay release the project renders for; the fix names it.
REQUIRED_RELEASE = "v1.7.0"
#: KubeRay release -> a RayJob field (its ``v1`` schema path, ``[]`` for a list's items) first declared in it and
#: kept since, and where: ``ray-project/kuberay``, ``ray-operator/apis/ray/v1/rayjob_types.go`` or
#: ``raycluster_types.go``, the commit that added it (its pull request), first in that tag's
#: ``ray-operator/config/crd/bases/ray.io_rayjobs.yaml``. Oldest first.
RELEASE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("v1.1.0", "spec.rayClusterSpec.workerGroupSpecs[].numOfHosts", "5adc91afc, #1834"),
    ("v1.2.0", "spec.backoffLimit", "8682b2d9c, #2192"),
    ("v1.3.0", "spec.managedBy", "e6af2cc60, #2589"),
    ("v1.4.0", "status.rayJobInfo", "bb5b7884b, #3673"),
    ("v1.5.0", "spec.deletionStrategy", "f5d71317b, #3731"),
    ("v1.6.0", "spec.preRunningDeadlineSeconds", "7092f76e6, #4525"),
    ("v1.7.0", "spec.rayClusterSpec.workerGroupSpecs[].priority", "556d1b43d, #4942"),
)
#: The label or annotation an installer may record the operator's version in (KubeRay's own CRDs have none).
VERSION_KEY = "app.kubernetes.io/version"
#: What to do about an older KubeRay.
FIX = (
    f"run KubeRay {REQUIRED_RELEASE} or later: with GKE's Ray Operator add-on, upgrade the cluster to a GKE version "
    "whose add-on ships it (GKE chooses the add-on's KubeRay; "
    "https://cloud.google.com/kubernetes-engine/docs/add-on/ray-on-gke/how-to/enable-ray-on-gke), or disable the "
    f"add-on and install KubeRay {REQUIRED_RELEASE}'s Helm chart (`helm install kuberay-operator "
    f"kuberay/kuberay-operator --version {REQUIRED_RELEASE[1:]}`) with the KubeRay TPU webhook; a KubeRay installed "
    "with Helm keeps the CRDs of its first install (`helm upgrade` leaves crds/ alone): apply them with `kubectl "
    "apply --server-side -k 'github.com/ray-project/kuberay/ray-operator/config/crd?ref="
    f"{REQUIRED_RELEASE}'`; see docs/gke-setup.md"
)


class KubeRayTooOld(PrerequisiteMissing):
    """The cluster's KubeRay CRDs lack what the rendered RayJob or KubeRay v1.7.0's behaviour needs; the message
    names the fields, the fix how to get KubeRay v1.7.0."""


def _kept(schema: dict[str, Any], key: str, root: bool) -> bool:
    """Whether the API server keeps field ``key`` of an object that ``schema`` does not declare: ``apiVersion``,
    ``kind`` and ``metadata`` of the resource and of an ``x-kubernetes-embedded-resource``, and anything under
    ``x-kubernetes-preserve-unknown-fields`` (pruning/algorithm.go)."""
    if key in ("apiVersion", "kind", "metadata") and (root or schema.get("x-kubernetes-embedded-resource")):
        return True
    return bool(schema.get("x-kubernetes-preserve-unknown-fields"))


def schema_gaps(schema: dict[str, Any], obj: Any, path: str = "", root: bool = False) -> list[str]:
    """Where a served CRD schema falls short of ``obj``: ``PATH: not declared`` (the API server would drop it),
    ``PATH: VALUE not in the enum [...]`` and ``PATH: required, not rendered`` (it would refuse the object).

    ``PATH`` as :data:`RELEASE_FIELDS` writes it (``[]`` for any item of a list); each gap once. With ``root``, the
    resource's own ``metadata`` is not walked (the API server checks ObjectMeta itself, not by the schema).
    """
    gaps: list[str] = []
    if "enum" in schema and not isinstance(obj, (dict, list)) and obj not in schema["enum"]:
        gaps.append(f"{path}: {obj!r} not in the enum {schema['enum']}")
    if isinstance(obj, dict):
        properties = schema.get("properties") or {}
        more = schema.get("additionalProperties")
        for key, value in obj.items():
            where = f"{path}.{key}" if path else key
            if root and key == "metadata":
                continue
            if key in properties:
                gaps += schema_gaps(properties[key], value, where)
            elif isinstance(more, dict):
                gaps += schema_gaps(more, value, where)
            elif more is not True and not _kept(schema, key, root):
                gaps.append(f"{where}: not declared")
        for key in schema.get("required") or []:
            if key not in obj and "default" not in properties.get(key, {}):
                gaps.append(f"{path}.{key}: required, not rendered" if path else f"{key}: required, not rendered")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            gaps += schema_gaps(schema["items"], item, f"{path}[]")
    return list(dict.fromkeys(gaps))


def declares(schema: dict[str, Any], path: str) -> bool:
    """Whether ``schema`` declares the field at ``path`` (``a.b[].c``, as :data:`RELEASE_FIELDS`)."""
    for part in path.split("."):
        name, items = (part[:-2], True) if part.endswith("[]") else (part, False)
        found = (schema.get("properties") or {}).get(name)
        if not isinstance(found, dict):
            return False
        schema = found
        if items:
            schema = schema.get("items") or {}
    return True


def release_of(schema: dict[str, Any]) -> str | None:
    """The newest KubeRay release whose fields (:data:`RELEASE_FIELDS`, and every older one's) a RayJob ``v1``
    schema declares; None: older than the first."""
    found = None
    for release, field, _ in RELEASE_FIELDS:
        if not declares(schema, field):
            break
        found = release
    return found


def _served_schema(kube: Kube, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The CRD ``name`` (raw) and its served ``v1`` ``openAPIV3Schema``.

    Raises:
        KubeRayTooOld: the CRD is gone or serves no ``v1`` schema (it was checked just before,
            :func:`multislice.backends.gke.cluster.check_crds`).
    """
    crd = cluster.read_crd(kube, name)
    if crd is None:
        raise KubeRayTooOld(f"CRD {name} is not installed: KubeRay is incomplete; nothing was created", FIX)
    for version in crd.get("spec", {}).get("versions") or []:
        if version.get("name") == SERVED_VERSION and version.get("served"):
            schema = (version.get("schema") or {}).get("openAPIV3Schema")
            if isinstance(schema, dict):
                return crd, schema
    raise KubeRayTooOld(f"CRD {name} serves no {SERVED_VERSION} schema; nothing was created", FIX)


def _recorded_version(*crds: dict[str, Any]) -> str:
    """The :data:`VERSION_KEY` label or annotation the CRDs carry, else that they record none."""
    found = []
    for crd in crds:
        metadata = crd.get("metadata") or {}
        labels, annotations = metadata.get("labels") or {}, metadata.get("annotations") or {}
        version = labels.get(VERSION_KEY) or annotations.get(VERSION_KEY)
        if version and f"{VERSION_KEY} {version}" not in found:
            found.append(f"{VERSION_KEY} {version}")
    return ", ".join(found) or "the CRDs record no version"


def check_kuberay(kube: Kube, rayjobs: dict[str, dict[str, Any]]) -> str:
    """Check the cluster's KubeRay CRDs declare every field of the stages' rendered RayJobs and KubeRay v1.7.0's
    (the module docstring); before anything is created.

    Args:
        rayjobs: Stage name -> its rendered RayJob (:func:`multislice.render.ray.render_rayjob`).

    Returns:
        One line saying what was checked.

    Raises:
        KubeRayTooOld: naming each field the served schemas lack (and the stages that render it), the newest release
            whose fields the CRDs have, a recorded version if any, and the fix.
        multislice.backends.gke.retry.ApiUnavailable: the API kept failing.
    """
    jobs_crd, jobs_schema = _served_schema(kube, RAYJOBS_CRD)
    clusters_crd, clusters_schema = _served_schema(kube, RAYCLUSTERS_CRD)
    cluster_spec = (clusters_schema.get("properties") or {}).get("spec") or {}
    gaps: dict[str, list[str]] = {}  # "CRD PATH: what" -> the stages whose RayJob has it
    for stage, manifest in rayjobs.items():
        found = [f"{RAYJOBS_CRD} {gap}" for gap in schema_gaps(jobs_schema, manifest, root=True)]
        spec = (manifest.get("spec") or {}).get("rayClusterSpec") or {}
        found += [f"{RAYCLUSTERS_CRD} {gap}" for gap in schema_gaps(cluster_spec, spec, "spec")]
        for gap in found:
            gaps.setdefault(gap, []).append(stage)
    marker = dict((release, field) for release, field, _ in RELEASE_FIELDS)[REQUIRED_RELEASE]
    in_cluster = "spec." + marker.removeprefix("spec.rayClusterSpec.")  # the same field of the RayCluster
    unmarked = [f"{RAYJOBS_CRD} {marker}"] if not declares(jobs_schema, marker) else []
    if not declares(clusters_schema, in_cluster):
        unmarked.append(f"{RAYCLUSTERS_CRD} {in_cluster}")
    if not gaps and not unmarked:
        return (
            f"KubeRay: {RAYJOBS_CRD} and {RAYCLUSTERS_CRD} {SERVED_VERSION} declare every field of the rendered "
            f"RayJob (stage(s) {', '.join(rayjobs)}) and KubeRay {REQUIRED_RELEASE}'s"
        )
    release = release_of(jobs_schema)
    matched = f"KubeRay {release}, the newest release they match" if release else f"older than {RELEASE_FIELDS[0][0]}"
    lines = [
        f"the cluster's KubeRay is older than {REQUIRED_RELEASE}, which the Ray launcher renders for: its CRDs "
        f"declare the fields of {matched} ({_recorded_version(jobs_crd, clusters_crd)})"
    ]
    if gaps:
        lines.append(
            "the API server would drop or refuse these of the rendered RayJob: "
            + "; ".join(f"{gap} (stage(s) {', '.join(stages)})" for gap, stages in gaps.items())
        )
    if unmarked:
        lines.append(
            f"not declared either: KubeRay {REQUIRED_RELEASE}'s {' and '.join(unmarked)} (KubeRay's behaviour the "
            "run relies on changes with its release)"
        )
    raise KubeRayTooOld("; ".join(lines) + "; nothing was created", FIX)
