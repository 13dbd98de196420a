"""Render the Kueue objects a multislice run is admitted through (``kueue.x-k8s.io/v1beta2``).

As in the JobSet project's TPU multislice example
(kubernetes-sigs/jobset ``site/static/examples/tpu-multislice/kueue-config.yaml``)
and GKE's tutorial
(https://cloud.google.com/kubernetes-engine/docs/tutorials/tpu-multislice-kueue):

- a ResourceFlavor selecting the slice's TPU nodes by accelerator and topology labels;
- a ClusterQueue covering ``google.com/tpu`` with a nominal quota of
  ``slices x chips per slice``, so that Kueue admits a JobSet only when all of
  its slices fit at once (all-or-nothing admission);
- a LocalQueue in the run's namespace, named by the JobSet's
  ``kueue.x-k8s.io/queue-name`` label;
- a WorkloadPriorityClass, named by the ``kueue.x-k8s.io/priority-class`` label.

Quota covers every pod set Kueue derives from the run's workloads, or Kueue leaves
the Workload pending with "resource R unavailable in ClusterQueue"
(``pkg/scheduler/flavorassigner/flavorassigner.go``, ``findFlavorForPodSets``).
:func:`pod_sets` derives them as Kueue v0.19.2 does from each stage's rendered
workload: a JobSet's pods request only ``google.com/tpu``; a RayJob adds its head
and its submitter (cpu and memory). When a stage's workload requests anything
besides TPU chips, the ClusterQueue gets a second resource group covering it,
with its own ResourceFlavor :data:`CPU_FLAVOR` (no node labels: any node), whose
nominal quota is the largest one stage needs (stages are admitted one at a time).

With DRANET (a Ray stage on node pools with ``node_pools.additional_node_networks``),
Kueue v0.19.2 (``KueueDRAIntegration``, beta, on by default) charges each
ResourceClaimTemplate's devices to the logical resource its Configuration maps
the DeviceClass to (``resources.deviceClassMappings``), and marks a Workload
whose DeviceClass has no mapping inadmissible (``pkg/dra/claims.go``,
``GetResourceRequestsForResourceClaimTemplates``). Kueue's Configuration is a
file in its own ConfigMap (:data:`KUEUE_CONFIG_NAMESPACE`/:data:`KUEUE_CONFIG_MAP`,
key :data:`KUEUE_CONFIG_KEY`; Kueue's ``config/components/manager`` and
``config/default`` kustomizations), read once at start: :func:`kueue_configuration`
renders the mapping for a cluster admin to merge (then restart Kueue's manager),
and the TPU resource group covers the mapped resource :data:`DRANET_RESOURCE`.

With ``node_pools.queued_provisioning`` (flex-start pools that grow only for
ProvisioningRequests), also, as xpk renders them (``src/xpk/core/kueue_manager.py``
and its Kueue templates) and GKE's queued-provisioning guide
(https://cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest):

- a ProvisioningRequestConfig with ``provisioningClassName:
  queued-provisioning.gke.io``, managing ``google.com/tpu``, whose pod-set
  update pins the pods to the nodes GKE created for the request (node selector
  ``autoscaling.gke.io/provisioning-request`` from the class detail
  ``ResizeRequestName``);
- an AdmissionCheck of Kueue's ProvisioningRequest controller
  (``kueue.x-k8s.io/provisioning-request``) with that config as parameters;
- the ClusterQueue listing it in ``admissionChecksStrategy`` (v1beta2 dropped
  ``spec.admissionChecks``), so Kueue admits a Workload only once its
  ProvisioningRequest is Provisioned.

Kueue v0.19 serves v1beta2 (storage) and v1beta1 (deprecated); v1beta2
renamed ``ClusterQueue.spec.cohort`` to ``cohortName``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from multislice import names, tpu
from multislice.plan import Plan
from multislice.render import launchers

API_VERSION = "kueue.x-k8s.io/v1beta2"
#: GKE's ProvisioningRequest class for flex-start with queued provisioning.
QUEUED_PROVISIONING_CLASS = "queued-provisioning.gke.io"
#: The controller name of Kueue's built-in ProvisioningRequest admission check.
PROVISIONING_CONTROLLER = "kueue.x-k8s.io/provisioning-request"
#: The node label GKE puts on the nodes of one ProvisioningRequest (xpk's ProvisioningRequestConfig template).
PROVISIONING_REQUEST_NODE_LABEL = "autoscaling.gke.io/provisioning-request"
#: The ResourceFlavor of what a run's pods request besides TPU chips (a RayJob's head and submitter): no node labels,
#: so Kueue matches it to any pod and adds no node selector on admission.
CPU_FLAVOR = "multislice-cpu"
#: The logical resource Kueue charges DRANET's network devices to (a ``deviceClassMappings`` entry's ``name``).
DRANET_RESOURCE = "multislice-pipelines/netdev"
#: Where Kueue's Configuration lives (Kueue v0.19.2 ``config/default/kustomization.yaml``: namespace
#: ``kueue-system``, name prefix ``kueue-``; ``config/components/manager``: ConfigMap ``manager-config`` from
#: ``controller_manager_config.yaml``; the Helm chart names it ``<release>-manager-config``).
KUEUE_CONFIG_NAMESPACE = "kueue-system"
KUEUE_CONFIG_MAP = "kueue-manager-config"
KUEUE_CONFIG_KEY = "controller_manager_config.yaml"
KUEUE_CONFIG_API = "config.kueue.x-k8s.io/v1beta2"
#: Kueue's feature gate of its DRA integration (beta, on by default since v0.18: ``pkg/features/kube_features.go``).
DRA_FEATURE_GATE = "KueueDRAIntegration"
#: What Kueue charges a RayJob's K8sJobMode submitter without ``submitterPodTemplate``: KubeRay's default submitter
#: container requests (Kueue v0.19.2 ``pkg/controller/jobs/rayjob/rayjob_controller.go``,
#: ``defaultSubmitterResources``, mirroring KubeRay ``ray-operator/controllers/ray/common/job.go``,
#: ``GetDefaultSubmitterContainer``).
SUBMITTER_REQUESTS = {"cpu": "500m", "memory": "200Mi"}
#: KubeRay's in-tree autoscaler sidecar, when ``enableInTreeAutoscaling`` (Kueue v0.19.2
#: ``pkg/controller/jobs/raycluster/common.go``, ``defaultAutoscalerResources``).
AUTOSCALER_REQUESTS = {"cpu": "500m", "memory": "512Mi"}
#: The resources Kueue takes from a pod-level ``spec.resources`` (k8s ``component-helpers/resource``,
#: ``IsSupportedPodLevelResource``; hugepages too).
_POD_LEVEL = ("cpu", "memory")

_SUFFIX = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
    "E": Decimal(10**18),
}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE]?)$")


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity (``4``, ``500m``, ``16Gi``, ``1e3``) as a number (cores, bytes, chips).

    Raises:
        ValueError: not a quantity (the API server's ``resource.Quantity`` grammar).
    """
    match = _QUANTITY.match(str(value).strip())
    if not match:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    number, suffix = match.groups()
    if suffix[:1] in ("e", "E"):
        return Decimal(number) * Decimal(10) ** int(suffix[1:])
    return Decimal(number) * _SUFFIX[suffix]


def quantity_text(resource: str, value: Decimal) -> str:
    """``value`` of ``resource`` as a quantity: cpu in whole cores or millicores (``4500m``), memory in the largest
    binary unit that holds it exactly (``16584Mi``), anything else as a number."""
    if resource == "cpu":
        millis = value * 1000
        return str(int(value)) if value == int(value) else f"{int(millis)}m"
    if resource == "memory" or resource.startswith("hugepages-"):
        for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
            if value >= _SUFFIX[suffix] and value % _SUFFIX[suffix] == 0:
                return f"{int(value / _SUFFIX[suffix])}{suffix}"
    return str(int(value)) if value == int(value) else str(value)


@dataclass(frozen=True)
class PodSet:
    """One pod set of a workload as Kueue counts it.

    Attributes:
        name: The pod set's name (a replicated job, ``head``, a worker group, ``submitter``).
        count: Pods in it.
        requests: One pod's requests, resource -> amount (cores, bytes, chips, devices).
    """

    name: str
    count: int
    requests: dict[str, Decimal] = field(default_factory=dict)


def _add(total: dict[str, Decimal], more: dict[str, Decimal]) -> None:
    for name, value in more.items():
        total[name] = total.get(name, Decimal(0)) + value


def _container_requests(container: dict[str, Any]) -> dict[str, Decimal]:
    resources = container.get("resources") or {}
    # Kueue takes a container's limits as its missing requests (pkg/workload/resources.go,
    # UseLimitsAsMissingRequestsInPod).
    given = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {name: quantity(value) for name, value in given.items()}


def pod_requests(pod: dict[str, Any]) -> dict[str, Decimal]:
    """One pod's requests as Kueue v0.19.2 computes them (``pkg/workload/workload.go``, ``totalRequestsFromPodSets``
    after ``AdjustResources``): each container's requests, its limits where a request is missing; the containers'
    sum, sidecars (init containers with ``restartPolicy: Always``) added, and the largest one-at-a-time init
    container's need if larger (k8s ``component-helpers/resource``, ``PodRequests``); pod-level cpu and memory
    requests replace the containers'; ``spec.overhead`` added. Not counted: a namespace's LimitRange defaults and a
    RuntimeClass's overhead (both read from the cluster).
    """
    total: dict[str, Decimal] = {}
    for container in pod.get("containers") or []:
        _add(total, _container_requests(container))
    sidecars: dict[str, Decimal] = {}
    init_peak: dict[str, Decimal] = {}
    for container in pod.get("initContainers") or []:
        need = _container_requests(container)
        if container.get("restartPolicy") == "Always":
            _add(total, need)
            _add(sidecars, need)
            need = dict(sidecars)
        else:
            _add(need, sidecars)
        for name, value in need.items():
            init_peak[name] = max(init_peak.get(name, Decimal(0)), value)
    for name, value in init_peak.items():
        total[name] = max(total.get(name, Decimal(0)), value)
    pod_level = ((pod.get("resources") or {}).get("requests")) or {}
    for name, value in pod_level.items():
        if name in _POD_LEVEL or name.startswith("hugepages-"):
            total[name] = quantity(value)
    _add(total, {name: quantity(value) for name, value in (pod.get("overhead") or {}).items()})
    return total


def _with_claims(
    pod: dict[str, Any], templates: dict[str, dict[str, Any]], mappings: dict[str, str]
) -> dict[str, Decimal]:
    """:func:`pod_requests` plus, for each ResourceClaimTemplate the pod claims, its devices charged to the logical
    resource their DeviceClass maps to (Kueue v0.19.2 ``pkg/dra/claims.go``: ``ExactCount`` requests, ``count``
    devices each); a template not in ``templates`` or a DeviceClass not in ``mappings`` is not counted."""
    requests = pod_requests(pod)
    for claim in pod.get("resourceClaims") or []:
        template = templates.get(claim.get("resourceClaimTemplateName") or "")
        for request in ((((template or {}).get("spec") or {}).get("spec") or {}).get("devices") or {}).get(
            "requests"
        ) or []:
            exactly = request.get("exactly") or {}
            resource = mappings.get(exactly.get("deviceClassName", ""))
            if resource:
                _add(requests, {resource: Decimal(exactly.get("count", 1))})
    return requests


def pod_sets(
    workload: dict[str, Any],
    claim_templates: Sequence[dict[str, Any]] = (),
    mappings: dict[str, str] | None = None,
) -> list[PodSet]:
    """The pod sets Kueue v0.19.2 builds for a JobSet or a RayJob, with each pod's requests (:func:`pod_requests`,
    DRA devices of ``claim_templates`` charged as ``mappings``: DeviceClass -> logical resource).

    - JobSet (``pkg/controller/jobs/jobset/jobset_controller.go``, ``PodSets``, ``podsCount``): one per replicated
      job, ``replicas`` x min(``parallelism``, ``completions``) pods.
    - RayJob (``pkg/controller/jobs/rayjob/rayjob_controller.go``, ``PodSets``; ``raycluster/common.go``,
      ``BuildPodSets``, ``effectiveWorkerCount``): ``head`` (one pod; KubeRay's autoscaler sidecar added with
      in-tree autoscaling), one per worker group (``replicas`` x ``numOfHosts`` pods), and with ``K8sJobMode``
      ``submitter`` (one pod: ``submitterPodTemplate``, else KubeRay's default submitter,
      :data:`SUBMITTER_REQUESTS`); with ``SidecarMode`` the submitter container is part of the head.

    Raises:
        ValueError: another kind, or a quantity that does not parse.
    """
    templates = {t["metadata"]["name"]: t for t in claim_templates}
    maps = mappings or {}
    kind = workload.get("kind")
    spec = workload.get("spec") or {}
    if kind == "JobSet":
        found = []
        for job in spec.get("replicatedJobs") or []:
            job_spec = job["template"]["spec"]
            parallelism = job_spec.get("parallelism", 1)
            per_replica = min(parallelism, job_spec.get("completions", parallelism))
            pod = job_spec["template"]["spec"]
            found.append(PodSet(job["name"], job.get("replicas", 1) * per_replica, _with_claims(pod, templates, maps)))
        return found
    if kind != "RayJob":
        raise ValueError(f"Kueue pod sets of a {kind}: only JobSet and RayJob are rendered")
    cluster = spec["rayClusterSpec"]
    head = dict(cluster["headGroupSpec"]["template"]["spec"])
    extra = []
    if cluster.get("enableInTreeAutoscaling"):
        extra.append({"name": "autoscaler", "resources": {"requests": AUTOSCALER_REQUESTS}})
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode == "SidecarMode":
        extra.append({"name": "ray-job-submitter", "resources": {"requests": SUBMITTER_REQUESTS}})
    head["containers"] = [*head.get("containers", []), *extra]
    found = [PodSet("head", 1, _with_claims(head, templates, maps))]
    for group in cluster.get("workerGroupSpecs") or []:
        count = group.get("replicas", 1) * max(1, group.get("numOfHosts", 1))
        found.append(PodSet(group["groupName"], count, _with_claims(group["template"]["spec"], templates, maps)))
    if mode == "K8sJobMode":
        template = spec.get("submitterPodTemplate")
        submitter = (template or {}).get("spec") or {
            "containers": [{"name": "ray-job-submitter", "resources": {"requests": SUBMITTER_REQUESTS}}]
        }
        found.append(PodSet("submitter", 1, _with_claims(submitter, templates, maps)))
    return found


def _kinds(plan: Plan, offered: bool) -> list[launchers.LauncherKind]:
    return launchers.offered_kinds(plan) if offered else launchers.kinds_of(plan)


def dra_mappings(plan: Plan, offered: bool = True) -> dict[str, str]:
    """DeviceClass -> the logical resource Kueue must charge it to, for the plan's DRA claims: DRANET's
    ``netdev.google.com`` -> :data:`DRANET_RESOURCE` when a launcher claims DRANET devices on node pools with
    additional networks; else empty.

    ``offered`` (what is rendered): every launcher a run of the compiled pipeline may pick
    (:func:`.launchers.offered_kinds`: ``launcher`` is a run parameter, as for RBAC); False (what provision checks
    on the cluster): the plan's own launchers only, so that a JobSet run is not refused for Ray's needs.
    """
    networks = plan.spec.node_pools.additional_node_networks
    if networks and any(kind.claims_dranet for kind in _kinds(plan, offered)):
        from multislice.render import ray  # jsonschema: only for a plan whose stages claim DRANET devices

        return {ray.DRANET_DEVICE_CLASS: DRANET_RESOURCE}
    return {}


#: The pipeline run id the quota's workloads are rendered with (labels do not change what they request).
_QUOTA_RUN_ID = "kueue-quota"


def stage_usage(plan: Plan, offered: bool = True) -> dict[str, Decimal]:
    """Resource -> the most any one stage's workload requests in all (pods x requests, over its pod sets,
    :func:`pod_sets` of the workload a launcher renders for the stage on TPU, with its DRA claim templates).

    ``offered``: each stage as every launcher the run form offers would launch it (a run that picks ``launcher: ray``
    needs quota for its RayJob's head and submitter, as it needs RBAC for its RayJob); False: its own launcher only.
    """
    mappings = dra_mappings(plan, offered)
    usage: dict[str, Decimal] = {}
    for stage in plan.stages:
        for kind in [launchers.kind_of(stage)] if not offered else launchers.offered_kinds(plan):
            workload = kind.render(plan, stage, "tpu", _QUOTA_RUN_ID)
            total: dict[str, Decimal] = {}
            for pod_set in pod_sets(workload, kind.companions(plan, stage, _QUOTA_RUN_ID), mappings):
                _add(total, {name: value * pod_set.count for name, value in pod_set.requests.items()})
            for name, value in total.items():
                usage[name] = max(usage.get(name, Decimal(0)), value)
    return usage


def kueue_configuration(plan: Plan) -> dict[str, Any] | None:
    """The part of Kueue's Configuration (``config.kueue.x-k8s.io/v1beta2``) the plan needs, for a cluster admin to
    merge into ConfigMap :data:`KUEUE_CONFIG_NAMESPACE`/:data:`KUEUE_CONFIG_MAP` (key :data:`KUEUE_CONFIG_KEY`),
    then restart Kueue's controller manager (it reads the file at start); None when it needs nothing.

    Source: Kueue v0.19.2 ``apis/config/v1beta2/configuration_types.go`` (``Resources.DeviceClassMappings``) and
    ``site/content/en/docs/tasks/manage/setup_dra.md``.
    """
    mappings = dra_mappings(plan)
    if not mappings:
        return None
    by_resource: dict[str, list[str]] = {}
    for device_class, resource in mappings.items():
        by_resource.setdefault(resource, []).append(device_class)
    return {
        "apiVersion": KUEUE_CONFIG_API,
        "kind": "Configuration",
        "resources": {
            "deviceClassMappings": [
                {"name": resource, "deviceClassNames": classes} for resource, classes in by_resource.items()
            ]
        },
    }


def admission_check_name(cluster_queue: str) -> str:
    """The AdmissionCheck of a ClusterQueue whose nodes come from queued provisioning: ``<cluster_queue>-dws``."""
    return f"{cluster_queue}-dws"


def provisioning_config_name(cluster_queue: str) -> str:
    """The ProvisioningRequestConfig the AdmissionCheck names: ``<cluster_queue>-dws-config``."""
    return f"{cluster_queue}-dws-config"


def render_queued_provisioning(cluster_queue: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    """ProvisioningRequestConfig and AdmissionCheck for flex-start with queued provisioning (both cluster-scoped).

    Source: xpk's Kueue templates (``ProvisioningRequestConfig`` ``dws-config``, ``AdmissionCheck`` ``dws-prov``)
    and Kueue v0.19.2's CRDs (``multislice/crds/kueue-v0.19.2``).
    """
    config_name = provisioning_config_name(cluster_queue)
    config = {
        "apiVersion": API_VERSION,
        "kind": "ProvisioningRequestConfig",
        "metadata": {"name": config_name, "labels": labels},
        "spec": {
            "provisioningClassName": QUEUED_PROVISIONING_CLASS,
            "managedResources": [tpu.TPU_RESOURCE],
            "podSetUpdates": {
                "nodeSelector": [
                    {"key": PROVISIONING_REQUEST_NODE_LABEL, "valueFromProvisioningClassDetail": "ResizeRequestName"}
                ]
            },
        },
    }
    check = {
        "apiVersion": API_VERSION,
        "kind": "AdmissionCheck",
        "metadata": {"name": admission_check_name(cluster_queue), "labels": labels},
        "spec": {
            "controllerName": PROVISIONING_CONTROLLER,
            "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": "ProvisioningRequestConfig", "name": config_name},
        },
    }
    return [config, check]


def resource_groups(plan: Plan) -> list[dict[str, Any]]:
    """The ClusterQueue's ``resourceGroups``: the TPU slices' flavor covering ``google.com/tpu`` (``slices x chips per
    slice``) and the DRA resources of the TPU pods (:func:`dra_mappings`); when a stage's workload, as any launcher
    the run form offers would render it, requests anything else (a RayJob's head and submitter: cpu, memory), a
    second group on :data:`CPU_FLAVOR` covering it, each with the most one stage needs (:func:`stage_usage`)."""
    usage = stage_usage(plan)
    dra = sorted(set(dra_mappings(plan).values()))
    tpu_resources = [{"name": tpu.TPU_RESOURCE, "nominalQuota": plan.total_chips}]
    tpu_resources += [{"name": name, "nominalQuota": int(usage.get(name, 0))} for name in dra]
    groups = [
        {
            "coveredResources": [tpu.TPU_RESOURCE, *dra],
            "flavors": [{"name": plan.spec.slice_type.flavor_name, "resources": tpu_resources}],
        }
    ]
    other = sorted(name for name in usage if name != tpu.TPU_RESOURCE and name not in dra)
    if other:
        groups.append(
            {
                "coveredResources": other,
                "flavors": [
                    {
                        "name": CPU_FLAVOR,
                        "resources": [{"name": n, "nominalQuota": quantity_text(n, usage[n])} for n in other],
                    }
                ],
            }
        )
    return groups


def cpu_flavor_needed(plan: Plan) -> bool:
    """Whether the ClusterQueue has the :data:`CPU_FLAVOR` resource group (a stage requests more than TPU chips)."""
    return len(resource_groups(plan)) > 1


def render_kueue_objects(plan: Plan) -> list[dict[str, Any]]:
    """ResourceFlavor(s), ClusterQueue, LocalQueue and WorkloadPriorityClass for a plan (and, with queued
    provisioning, the ProvisioningRequestConfig and AdmissionCheck the ClusterQueue names).

    Returns:
        Four objects as plain data, cluster-scoped first (five with a stage launched by Ray: the CPU ResourceFlavor
        after the TPU one; two more with queued provisioning: before the ClusterQueue that names them).
    """
    spec = plan.spec
    shape = spec.slice_type
    labels = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
    flavor = {
        "apiVersion": API_VERSION,
        "kind": "ResourceFlavor",
        "metadata": {"name": shape.flavor_name, "labels": labels},
        "spec": {
            "nodeLabels": {
                tpu.ACCELERATOR_LABEL: shape.gke_accelerator,
                tpu.TOPOLOGY_LABEL: shape.topology,
            }
        },
    }
    cluster_queue = {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": spec.cluster_queue, "labels": labels},
        "spec": {
            "namespaceSelector": {},
            "queueingStrategy": "BestEffortFIFO",
            "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Never"},
            "resourceGroups": resource_groups(plan),
        },
    }
    flavors = [flavor]
    if len(cluster_queue["spec"]["resourceGroups"]) > 1:
        flavors.append(
            {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": CPU_FLAVOR, "labels": labels}}
        )
    queued = spec.node_pools.queued_provisioning
    if queued:
        cluster_queue["spec"]["admissionChecksStrategy"] = {
            "admissionChecks": [{"name": admission_check_name(spec.cluster_queue)}]
        }
    local_queue = {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": spec.queue, "namespace": spec.namespace, "labels": labels},
        "spec": {"clusterQueue": spec.cluster_queue},
    }
    priority = {
        "apiVersion": API_VERSION,
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": spec.priority, "labels": labels},
        "value": spec.priority_value,
        "description": "Priority of multislice training workloads (rendered by multislice-pipelines).",
    }
    provisioning = render_queued_provisioning(spec.cluster_queue, labels) if queued else []
    return [*flavors, *provisioning, cluster_queue, priority, local_queue]
