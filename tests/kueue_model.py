"""Test support: Kueue v0.19.2's admission of one Workload, computed from what the emulated cluster stores.

The emulator's Kueue (:class:`tests.kube_controllers.Play`, :class:`tests.kube_controllers.KubeRay`) admits a
Workload only when this model does, and otherwise writes the condition Kueue writes. Each step follows
kubernetes-sigs/kueue at tag v0.19.2 with Kueue's default feature gates (read with ``git show v0.19.2:<path>``);
it is written independently of :mod:`multislice.render.kueue`, whose quota it checks:

1. Pod sets (:func:`pod_sets`, stored in the Workload's ``spec.podSets`` as Kueue's job framework does):
   JobSet, ``pkg/controller/jobs/jobset/jobset_controller.go`` ``PodSets``/``podsCount`` (one per replicated job,
   ``replicas`` x min(``parallelism``, ``completions``)); RayJob, ``pkg/controller/jobs/rayjob/rayjob_controller.go``
   ``PodSets``/``addSubmitterPodSet``/``getSubmitterTemplate``/``defaultSubmitterResources`` and
   ``pkg/controller/jobs/raycluster/common.go`` ``BuildPodSets``/``effectiveWorkerCount``/``autoscalerContainer``
   (``head`` 1 pod, each worker group ``replicas`` x ``numOfHosts``, ``submitter`` 1 pod with KubeRay's default
   500m / 200Mi when ``K8sJobMode`` has no ``submitterPodTemplate``).
2. Queues: ``pkg/controller/core/workload_controller.go`` ``getQueueBlocker`` ("LocalQueue Q doesn't exist",
   "ClusterQueue C doesn't exist", reason ``Misconfigured``).
3. DRA: ``pkg/controller/core/workload_controller.go`` (Reconcile: a ``resourceClaimName`` is refused; with
   ``featureGates.KueueDRAIntegration: false`` a Workload with claims is rejected) and ``pkg/dra/claims.go``
   ``GetResourceRequestsForResourceClaimTemplates``/``countDevicesPerClass``: an ``ExactCount`` request's devices
   are charged to the logical resource ``resources.deviceClassMappings`` maps its DeviceClass to; an unmapped
   DeviceClass is a ``field.NotFound`` whose text becomes the QuotaReserved False message, reason ``Inadmissible``
   (``UnadmittedWorkloadReasonWithFallback``: ``UnadmittedWorkloadsObservability`` is off by default).
4. Requests: ``pkg/workload/resources.go`` ``AdjustResources`` (limits as missing requests) and
   ``pkg/workload/workload.go`` ``totalRequestsFromPodSets`` with k8s ``component-helpers/resource`` ``PodRequests``
   (containers summed, sidecars added, the init containers' peak, pod-level cpu/memory, ``spec.overhead``),
   ``resources.excludeResourcePrefixes`` dropped, per pod x count; cpu in millicores, others in units
   (``pkg/resources/resource.go`` ``ResourceValue``).
5. Flavor assignment: ``pkg/scheduler/flavorassigner/flavorassigner.go`` ``assignFlavors`` (each pod set its own
   group, its resources in ``SliceRequests`` order: FNV-1a 64 hash of the name, ``pkg/resources/slice_requests.go``,
   ``VectorizedResourceRequests`` on by default), ``findFlavorForPodSets`` ("resource %s unavailable in
   ClusterQueue"; the resource group's flavors in order), ``checkFlavorForPodSets`` (untolerated NoSchedule /
   NoExecute taints, node selector and required node affinity on the flavor's own label keys),
   ``fitsResourceQuota`` ("insufficient quota for %s in flavor %s, previously considered podsets requests (%s) +
   current podset request (%s) > maximum capacity (%s)" above the nominal quota; "insufficient unused quota for %s
   in flavor %s, %s more needed" above what other admitted Workloads of the ClusterQueue leave), ``Message``
   ("couldn't assign flavors to pod set %s: " + reasons sorted, ``, ``-joined; pod sets ``; ``-joined) and the
   quantity texts of ``pkg/resources/resource_formatter.go``.
6. The condition: ``pkg/scheduler/scheduler.go`` ``requeueAndUpdate``: QuotaReserved False, reason ``Pending``
   (the granular reasons need ``UnadmittedWorkloadsObservability``), the assignment's message; Admitted False
   ``NoReservation`` (``pkg/workload/workload.go`` ``UnsetQuotaReservationWithCondition``).

Not modelled (docs/testing.md keeps this list): cohorts, borrowing and lending limits, preemption (a pod set that
fits the nominal quota but not what others hold stays pending, as when no preemption candidate exists), fair
sharing, admission fair sharing, partial admission, topology-aware scheduling, a namespace's LimitRanges, a
RuntimeClass's overhead, resource transformations, ``quotaCheckStrategy``, the ClusterQueue's namespace selector
and stop policy, inactive queues, CEL device selectors and the partitionable/consumable-capacity DRA modes, the
scheduling cycle's ordering of several pending Workloads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from decimal import ROUND_CEILING
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

#: Kueue's ``KueueDRAIntegration`` feature gate and its default (beta, on; ``pkg/features/kube_features.go``).
DRA_GATE = "KueueDRAIntegration"
SUBMITTER = {"cpu": "500m", "memory": "200Mi"}
AUTOSCALER = {"cpu": "500m", "memory": "512Mi"}
#: Kueue's ConfigMap: kustomize ``config/default`` (namespace kueue-system, prefix kueue-) over ``config/components/
#: manager`` (``manager-config``, file ``controller_manager_config.yaml``).
CONFIG_NAMESPACE, CONFIG_MAP, CONFIG_KEY = "kueue-system", "kueue-manager-config", "controller_manager_config.yaml"
#: Kueue v0.19.2's shipped Configuration (``config/components/manager/controller_manager_config.yaml``), the parts
#: this model reads: no ``resources`` section, no feature gate overrides.
DEFAULT_CONFIGURATION = {
    "apiVersion": "config.kueue.x-k8s.io/v1beta2",
    "kind": "Configuration",
    "integrations": {"frameworks": ["batch/job", "ray.io/rayjob", "ray.io/raycluster", "jobset.x-k8s.io/jobset"]},
}


def fnv1a64(name: str) -> int:
    """Go's ``hash/fnv`` ``New64a`` of ``name`` (Kueue orders a ``SliceRequests`` by it, then by name)."""
    value = 0xCBF29CE484222325
    for byte in name.encode():
        value = ((value ^ byte) * 0x100000001B3) % 2**64
    return value


def ordered(names: Any) -> list[str]:
    """Resource names in Kueue's ``SliceRequests`` order."""
    return sorted(names, key=lambda n: (fnv1a64(n), n))


def resource_value(name: str, value: Any) -> int:
    """Kueue's ``ResourceValue``: cpu in millicores, anything else in units rounded up."""
    number = parse_quantity(value)
    if name == "cpu":
        return int((number * 1000).to_integral_value(rounding=ROUND_CEILING))
    return int(number.to_integral_value(rounding=ROUND_CEILING))


_DECIMAL = {-9: "n", -6: "u", -3: "m", 0: "", 3: "k", 6: "M", 9: "G", 12: "T", 15: "P", 18: "E"}
_BINARY = {10: "Ki", 20: "Mi", 30: "Gi", 40: "Ti", 50: "Pi", 60: "Ei"}


def _decimal_text(mantissa: int, exponent: int) -> str:
    """apimachinery ``Quantity.String`` for DecimalSI: the largest multiple-of-3 exponent keeping an integer."""
    if mantissa == 0:
        return "0"
    while mantissa % 1000 == 0 and exponent < 18:
        mantissa //= 1000
        exponent += 3
    return f"{mantissa}{_DECIMAL[exponent]}"


def quantity_text(name: str, value: int) -> str:
    """Kueue's ``ResourceFormatter.ResourceQuantityString``: cpu as a milli DecimalSI quantity, memory (and
    hugepages) canonical BinarySI (DecimalSI below 1024), others DecimalSI."""
    if name == "cpu":
        return _decimal_text(value, -3)
    if name in ("memory", "ephemeral-storage") or name.startswith("hugepages-"):
        if -1024 < value < 1024:
            return _decimal_text(value, 0)
        for power in sorted(_BINARY, reverse=True):
            if value % 2**power == 0:
                return f"{value // 2**power}{_BINARY[power]}"
        return str(value)
    return _decimal_text(value, 0)


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for name, value in more.items():
        total[name] = total.get(name, 0) + value


def _requests(container: dict[str, Any]) -> dict[str, int]:
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}  # UseLimitsAsMissingRequests
    return {name: resource_value(name, value) for name, value in merged.items()}


def pod_requests(pod: dict[str, Any]) -> dict[str, int]:
    """k8s ``PodRequests`` after Kueue's ``UseLimitsAsMissingRequestsInPod`` (module docstring, step 4)."""
    total: dict[str, int] = {}
    for container in pod.get("containers") or []:
        _add(total, _requests(container))
    restartable: dict[str, int] = {}
    peak: dict[str, int] = {}
    for container in pod.get("initContainers") or []:
        need = _requests(container)
        if container.get("restartPolicy") == "Always":
            _add(total, need)
            _add(restartable, need)
            need = dict(restartable)
        else:
            _add(need, restartable)
        for name, value in need.items():
            peak[name] = max(peak.get(name, 0), value)
    for name, value in peak.items():
        total[name] = max(total.get(name, 0), value)
    for name, value in (((pod.get("resources") or {}).get("requests")) or {}).items():
        if name in ("cpu", "memory") or name.startswith("hugepages-"):
            total[name] = resource_value(name, value)
    _add(total, {name: resource_value(name, value) for name, value in (pod.get("overhead") or {}).items()})
    return total


def pod_sets(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The Workload ``spec.podSets`` Kueue builds for a JobSet or RayJob (``name``, ``count``, ``template``)."""
    spec = obj["spec"]
    if obj["kind"] == "JobSet":
        found = []
        for job in spec["replicatedJobs"]:
            job_spec = job["template"]["spec"]
            parallelism = job_spec.get("parallelism", 1)
            count = job.get("replicas", 1) * min(parallelism, job_spec.get("completions", parallelism))
            found.append({"name": job["name"], "count": count, "template": copy.deepcopy(job_spec["template"])})
        return found
    assert obj["kind"] == "RayJob", obj["kind"]
    cluster = spec["rayClusterSpec"]
    head = copy.deepcopy(cluster["headGroupSpec"]["template"])
    if cluster.get("enableInTreeAutoscaling"):
        head["spec"]["containers"].append({"name": "autoscaler", "resources": {"requests": AUTOSCALER,
                                                                               "limits": AUTOSCALER}})  # fmt: skip
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode == "SidecarMode":
        head["spec"]["containers"].append({"name": "ray-job-submitter", "resources": {"requests": SUBMITTER}})
    found = [{"name": "head", "count": 1, "template": head}]
    for group in cluster.get("workerGroupSpecs") or []:
        count = group.get("replicas", 1) * (group["numOfHosts"] if group.get("numOfHosts", 1) > 1 else 1)
        found.append({"name": group["groupName"], "count": count, "template": copy.deepcopy(group["template"])})
    if mode == "K8sJobMode":
        submitter = {"name": "ray-job-submitter", "image": head["spec"]["containers"][0].get("image"),
                     "resources": {"requests": SUBMITTER, "limits": {"cpu": "1", "memory": "1Gi"}}}  # fmt: skip
        default = {"spec": {"restartPolicy": "Never", "containers": [submitter]}}
        template = copy.deepcopy(spec.get("submitterPodTemplate")) or default
        found.append({"name": "submitter", "count": 1, "template": template})
    return found


@dataclass
class Verdict:
    """What Kueue does with a Workload: ``admission`` (its ``status.admission``) or the QuotaReserved False
    condition's ``reason`` and ``message``."""

    admission: dict[str, Any] | None = None
    reason: str = ""
    message: str = ""


@dataclass
class _PodSetAssignment:
    name: str
    count: int
    requests: dict[str, int]
    flavors: dict[str, str] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)
    failed: bool = False


class _Rejected(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


class Kueue:
    """Kueue's decision for one Workload, from the ClusterQueue, ResourceFlavors, LocalQueue, ResourceClaimTemplates,
    Kueue's ConfigMap and the other admitted Workloads stored in the emulator (read through ``play``'s clients)."""

    def __init__(self, play: Any):
        self.play = play

    # -- reads ---------------------------------------------------------------

    def _get(self, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        custom = self.play.custom
        try:
            if namespace:
                return custom.get_namespaced_custom_object("kueue.x-k8s.io", "v1beta2", namespace, plural, name)
            return custom.get_cluster_custom_object("kueue.x-k8s.io", "v1beta2", plural, name)
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def configuration(self) -> dict[str, Any]:
        """Kueue's Configuration from its ConfigMap in the emulator; Kueue's shipped one when there is none."""
        try:
            found = self.play.core.read_namespaced_config_map(CONFIG_MAP, CONFIG_NAMESPACE)
        except ApiException as error:
            if error.status != 404:
                raise
            return DEFAULT_CONFIGURATION
        return yaml.safe_load((found.data or {}).get(CONFIG_KEY) or "") or {}

    def _claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.play.custom.get_namespaced_custom_object(
                "resource.k8s.io", "v1", namespace, "resourceclaimtemplates", name
            )
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def _usage_by_others(self, cluster_queue: str, name: str) -> dict[tuple[str, str], int]:
        """(flavor, resource) -> what the other Workloads with quota reserved in ``cluster_queue`` hold."""
        usage: dict[tuple[str, str], int] = {}
        listed = self.play.custom.list_cluster_custom_object("kueue.x-k8s.io", "v1beta2", "workloads")["items"]
        for other in listed:
            status = other.get("status") or {}
            conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
            admission = status.get("admission") or {}
            if other["metadata"]["name"] == name or conditions.get("QuotaReserved") != "True":
                continue
            if conditions.get("Finished") == "True" or admission.get("clusterQueue") != cluster_queue:
                continue
            for assignment in admission.get("podSetAssignments") or []:
                for resource, amount in (assignment.get("resourceUsage") or {}).items():
                    flavor = (assignment.get("flavors") or {}).get(resource)
                    if flavor:
                        key = (flavor, resource)
                        usage[key] = usage.get(key, 0) + resource_value(resource, amount)
        return usage

    # -- the decision --------------------------------------------------------

    def decide(self, workload: dict[str, Any]) -> Verdict:
        """Admit ``workload`` (a stored Workload with ``spec.podSets``) or say why not (module docstring)."""
        namespace = workload["metadata"]["namespace"]
        queue = workload["spec"].get("queueName", "")
        local = self._get("localqueues", queue, namespace)
        if local is None:
            return Verdict(reason="Misconfigured", message=f"LocalQueue {queue} doesn't exist")
        cq_name = local["spec"]["clusterQueue"]
        cq = self._get("clusterqueues", cq_name)
        if cq is None:
            return Verdict(reason="Misconfigured", message=f"ClusterQueue {cq_name} doesn't exist")
        configuration = self.configuration()
        try:
            dra = self._dra_requests(workload, configuration)
        except _Rejected as rejected:
            return Verdict(reason=rejected.reason, message=rejected.message)
        excluded = tuple(((configuration.get("resources") or {}).get("excludeResourcePrefixes")) or ())
        sets = []
        for index, pod_set in enumerate(workload["spec"]["podSets"]):
            per_pod = pod_requests(pod_set["template"].get("spec") or {})
            per_pod = {n: v for n, v in per_pod.items() if not (excluded and n.startswith(excluded))}
            _add(per_pod, dra.get(index, {}))
            count = pod_set["count"]
            sets.append(_PodSetAssignment(pod_set["name"], count, {n: v * count for n, v in per_pod.items()}))
        return self._assign(workload, cq, sets)

    def _dra_requests(self, workload: dict[str, Any], configuration: dict[str, Any]) -> dict[int, dict[str, int]]:
        """Pod set index -> the logical DRA resources one pod needs; raises :class:`_Rejected` as Kueue's workload
        controller marks it inadmissible (module docstring, step 3)."""
        pod_sets_ = workload["spec"]["podSets"]
        claims = [(i, j, c) for i, ps in enumerate(pod_sets_)
                  for j, c in enumerate((ps["template"].get("spec") or {}).get("resourceClaims") or [])]  # fmt: skip
        if not claims:
            return {}
        if (configuration.get("featureGates") or {}).get(DRA_GATE, True) is False:
            raise _Rejected(
                "Inadmissible", "Workload uses DRA resources but the KueueDRAIntegration feature gate is not enabled"
            )
        if any(c.get("resourceClaimName") for _, _, c in claims):
            raise _Rejected("Inadmissible", "KueueDRAIntegration feature does not support use of resource claims")
        mappings = {
            device_class: entry["name"]
            for entry in ((configuration.get("resources") or {}).get("deviceClassMappings")) or []
            for device_class in entry.get("deviceClassNames") or []
        }
        found: dict[int, dict[str, int]] = {}
        namespace = workload["metadata"]["namespace"]
        for i, j, claim in claims:
            name = claim.get("resourceClaimTemplateName")
            if not name:
                continue
            where = f"spec.podSets[{i}].template.spec.resourceClaims[{j}]"
            template = self._claim_template(namespace, name)
            if template is None:
                raise _Rejected("Inadmissible", f"{where}: Internal error: failed to get claim spec for "
                                f"ResourceClaimTemplate {name} in podset {pod_sets_[i]['name']}: "
                                f'resourceclaimtemplates.resource.k8s.io "{name}" not found')  # fmt: skip
            counts: dict[str, int] = {}
            for request in template["spec"]["spec"].get("devices", {}).get("requests") or []:
                exactly = request.get("exactly")
                assert exactly and exactly.get("allocationMode", "ExactCount") == "ExactCount", "not modelled"
                counts[exactly["deviceClassName"]] = counts.get(exactly["deviceClassName"], 0) + exactly.get("count", 1)
            for device_class in ordered(counts):
                if device_class not in mappings:
                    raise _Rejected(
                        "Inadmissible",
                        f'{where}.resourceClaimTemplateName: Not found: "DeviceClass {device_class} is not mapped in '
                        f'DRA configuration for podset {pod_sets_[i]["name"]}"',
                    )
                _add(found.setdefault(i, {}), {mappings[device_class]: counts[device_class]})
        return found

    def _flavor_mismatch(self, flavor: dict[str, Any] | None, name: str, pod: dict[str, Any]) -> str | None:
        """``checkFlavorForPodSets``: why the flavor does not suit the pod, or None."""
        if flavor is None:
            return f"flavor {name} not found"
        spec = flavor.get("spec") or {}
        labels = spec.get("nodeLabels") or {}
        tolerations = [*(pod.get("tolerations") or []), *(spec.get("tolerations") or [])]
        for taint in spec.get("nodeTaints") or []:
            if taint.get("effect") not in ("NoSchedule", "NoExecute"):
                continue
            if not any(_tolerates(t, taint) for t in tolerations):
                value = f"={taint['value']}" if taint.get("value") else ""
                return f"untolerated taint {taint['key']}{value}:{taint['effect']} in flavor {name}"
        for key, value in (pod.get("nodeSelector") or {}).items():
            if key in labels and labels[key] != value:
                return f"flavor {name} doesn't match node affinity"
        affinity = (pod.get("affinity") or {}).get("nodeAffinity") or {}
        required = (affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
        terms = []
        for term in required:
            kept = [e for e in term.get("matchExpressions") or [] if e["key"] in labels]
            if not kept:
                terms = []
                break
            terms.append(kept)
        if terms and not any(all(_matches(e, labels) for e in term) for term in terms):
            return f"flavor {name} doesn't match node affinity"
        return None

    def _assign(self, workload: dict[str, Any], cq: dict[str, Any], sets: list[_PodSetAssignment]) -> Verdict:
        """``assignFlavors`` over the pod sets (module docstring, step 5)."""
        groups = cq["spec"].get("resourceGroups") or []
        group_of = {r: g for g in groups for r in g.get("coveredResources") or []}
        quota = {(f["name"], r["name"]): resource_value(r["name"], r["nominalQuota"])
                 for g in groups for f in g.get("flavors") or [] for r in f.get("resources") or []}  # fmt: skip
        others = self._usage_by_others(cq["metadata"]["name"], workload["metadata"]["name"])
        assumed: dict[tuple[str, str], int] = {}
        templates = {ps["name"]: ps["template"].get("spec") or {} for ps in workload["spec"]["podSets"]}
        flavors: dict[str, dict[str, Any] | None] = {}
        for pod_set in sets:
            if "pods" in group_of:
                pod_set.requests["pods"] = pod_set.count
            chosen: dict[str, str] = {}
            for resource in ordered(pod_set.requests):
                amount = pod_set.requests[resource]
                group = group_of.get(resource)
                if group is None:
                    if amount == 0:
                        continue
                    pod_set.reasons, pod_set.failed = [f"resource {resource} unavailable in ClusterQueue"], True
                    break
                if resource in chosen:
                    continue
                covered = [r for r in ordered(pod_set.requests) if r in group["coveredResources"]]
                best, best_rank, reasons = None, -1, []
                for flavor in group.get("flavors") or []:
                    fname = flavor["name"]
                    if fname not in flavors:
                        flavors[fname] = self._get("resourceflavors", fname)
                    mismatch = self._flavor_mismatch(flavors[fname], fname, templates[pod_set.name])
                    if mismatch:
                        reasons.append(mismatch)
                        continue
                    rank = 2  # fit
                    for name in covered:
                        fr = (fname, name)
                        nominal = quota.get(fr, 0)
                        before = assumed.get(fr, 0)
                        value = before + pod_set.requests[name]
                        if value > nominal:
                            reasons.append(
                                f"insufficient quota for {name} in flavor {fname}, previously considered podsets "
                                f"requests ({quantity_text(name, before)}) + current podset request "
                                f"({quantity_text(name, pod_set.requests[name])}) > maximum capacity "
                                f"({quantity_text(name, nominal)})"
                            )
                            rank = 0  # noFit
                        elif value > nominal - others.get(fr, 0):
                            more = value - (nominal - others.get(fr, 0))
                            reasons.append(f"insufficient unused quota for {name} in flavor {fname}, "
                                           f"{quantity_text(name, more)} more needed")  # fmt: skip
                            rank = min(rank, 1)  # preemption not modelled: no candidates
                    if rank == 2:
                        best, best_rank = fname, rank
                        reasons = []  # a fitting flavor: Kueue returns it without a status
                        break
                    if rank > best_rank and rank > 0:
                        best, best_rank = fname, rank
                if best is None:
                    pod_set.reasons, pod_set.failed = reasons, True
                    break
                for name in covered:
                    chosen[name] = best
                pod_set.reasons += reasons
            if pod_set.failed:
                break
            pod_set.flavors = chosen
            for name, flavor_name in chosen.items():
                assumed[(flavor_name, name)] = assumed.get((flavor_name, name), 0) + pod_set.requests[name]
        unfit = [p for p in sets if p.failed or p.reasons]
        if unfit:
            message = "; ".join(
                f"couldn't assign flavors to pod set {p.name}: {', '.join(sorted(p.reasons))}" for p in unfit
            )
            return Verdict(reason="Pending", message=message)
        return Verdict(
            admission={
                "clusterQueue": cq["metadata"]["name"],
                "podSetAssignments": [
                    {
                        "name": p.name,
                        "count": p.count,
                        "flavors": {r: p.flavors[r] for r in ordered(p.flavors)},
                        "resourceUsage": {r: quantity_text(r, p.requests[r]) for r in ordered(p.requests)},
                    }
                    for p in sets
                ],
            }
        )


def _tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """``corev1 Toleration.ToleratesTaint``."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return toleration.get("value", "") == taint.get("value", "") and bool(toleration.get("key"))


def _matches(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return labels.get(key) not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise AssertionError(f"node affinity operator {operator} not modelled")
