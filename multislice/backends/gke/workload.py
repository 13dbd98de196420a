"""The Kueue Workload of a JobSet: finding it, its admission state, and waiting for admission.

Kueue's JobSet integration creates one Workload per JobSet, owned by it
(``metadata.ownerReferences`` kind ``JobSet``, name and uid). Conditions read
(Kueue v1beta2 ``WorkloadStatus``,
https://kueue.sigs.k8s.io/docs/concepts/workload/#workload-conditions):
``QuotaReserved`` (quota assigned in a ClusterQueue; while False its reason
``Pending`` and message say why, e.g. insufficient quota), ``Admitted``
(quota reserved and admission checks passed: the JobSet is unsuspended),
``Evicted`` (reason ``Preempted``, ``PodsReadyTimeout``, ...; the JobSet is
suspended again and requeued) and ``Finished``. ``status.admission`` names
the ClusterQueue and, per pod set, the flavor assigned to each resource.

Some waits never end by themselves; admit fails at once on them
(:func:`blocked`), quoting Kueue's own words:

- QuotaReserved False, ``LocalQueue Q doesn't exist`` / ``ClusterQueue C
  doesn't exist`` (Kueue ``pkg/controller/core/workload_controller.go``,
  reason ``Inadmissible``, ``Misconfigured`` in later releases);
- ``couldn't assign flavors to pod set P: resource R unavailable in
  ClusterQueue`` (``pkg/scheduler/flavorassigner/flavorassigner.go``: no
  resource group covers R; e.g. a RayJob's head and submitter request cpu and
  memory, a queue rendered for JobSets covers only ``google.com/tpu``);
- reason ``Inadmissible``, ``spec.podSets[i]...: Not found: "DeviceClass D is
  not mapped in DRA configuration for podset P"`` (``pkg/dra/claims.go``: a
  DRANET claim whose DeviceClass Kueue's Configuration does not map), and
  ``Workload uses DRA resources but the KueueDRAIntegration feature gate is
  not enabled`` (``pkg/controller/core/workload_controller.go``);
- no Workload at all and a Warning event ``WorkloadPriorityClassNotFound``
  (``WorkloadPriorityClass "p" not found``) on the JobSet: Kueue creates no
  Workload for a JobSet whose ``kueue.x-k8s.io/priority-class`` does not exist
  (kubernetes-sigs/kueue #3439; documented in #13645, event added in #13775).
  Kueue releases before that event post nothing: the pending reason then names
  the priority class among the things to check;
- an admission check in state ``Rejected`` (``status.admissionChecks[]``).

With queued provisioning (``node_pools.queued_provisioning``) the ClusterQueue
names a ProvisioningRequest AdmissionCheck: once quota is reserved, Kueue
creates a ProvisioningRequest ``<workload>-<admission check>-<attempt>`` and
mirrors its conditions into the Workload's ``status.admissionChecks[]``
(``state``, ``message``; kubernetes-sigs/kueue
``pkg/controller/admissionchecks/provisioning/controller.go``,
``syncCheckStates``): Accepted and waiting -> ``Pending`` with the request's
Provisioned message (e.g. an ETA); Provisioned -> ``Ready`` (then Admitted);
Failed or BookingExpired with retries left (3 by default) -> ``Pending``,
"Retrying after failure: ..."; Failed with none left, or CapacityRevoked ->
``Rejected`` with the request's message (Kueue then deactivates the Workload).
Admit reads that mirror rather than the ProvisioningRequest itself: it carries
the state and Cluster Autoscaler's message, and needs no RBAC on
``autoscaling.x-k8s.io``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, TypeGuard

from kubernetes.client.exceptions import ApiException

from multislice.backends.base import AdmissionBlocked, AdmissionTimeout, WorkloadDeleted
from multislice.backends.gke import jobset, watch
from multislice.backends.gke.client import KUEUE_GROUP, KUEUE_VERSION, WORKLOAD_PLURAL, Kube
from multislice.render import kueue


def owned_by(workload: dict[str, Any], js: dict[str, Any]) -> bool:
    """True when the Workload's owner references name this JobSet (or RayJob: its ``kind``; by uid when both have
    one). Kueue's RayJob integration owns the Workload by the RayJob the same way (``rayjob-<name>-<hash>``,
    ``pkg/controller/jobs/rayjob/rayjob_controller.go``, ``GetWorkloadNameForRayJob``)."""
    uid = js["metadata"].get("uid")
    kind = js.get("kind") or "JobSet"
    for ref in workload.get("metadata", {}).get("ownerReferences", []) or []:
        if ref.get("kind") == kind and ref.get("name") == js["metadata"]["name"]:
            if not uid or not ref.get("uid") or ref["uid"] == uid:
                return True
    return False


def find(kube: Kube, js: dict[str, Any]) -> dict[str, Any] | None:
    """The Workload Kueue created for the JobSet, or None (not yet)."""
    for item in kube.list_workloads():
        if owned_by(item, js):
            return item
    return None


def admitted(workload: dict[str, Any] | None) -> TypeGuard[dict[str, Any]]:
    """True when the Workload is Admitted and not Evicted."""
    return bool(workload) and bool(jobset.condition(workload, "Admitted")) and not jobset.condition(workload, "Evicted")


#: Kueue's ``integrations.frameworks`` entry of each workload kind.
FRAMEWORKS = {"JobSet": "jobset.x-k8s.io/jobset", "RayJob": "ray.io/rayjob"}


def admission_checks(workload: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The Workload's ``status.admissionChecks`` (``name``, ``state``: Pending, Ready, Retry or Rejected,
    ``message``); empty when its ClusterQueue names none (Kueue v1beta2 ``AdmissionCheckState``)."""
    return list(((workload or {}).get("status") or {}).get("admissionChecks") or [])


def checks_line(checks: list[dict[str, Any]]) -> str:
    """``AdmissionCheck <name> <state>: <message>`` for each check, ``; ``-joined."""
    return "; ".join(
        f"AdmissionCheck {c.get('name')} {c.get('state') or 'Pending'}"
        + (f": {c['message']}" if c.get("message") else "")
        for c in checks
    )


def pending_reason(workload: dict[str, Any] | None, js_name: str, queue: str, kind: str = "JobSet") -> str:
    """Why the Workload is not admitted, from its conditions (most telling first); with quota reserved and
    admission checks not Ready (queued provisioning: the ProvisioningRequest's state), those checks."""
    if workload is None:
        return (
            f"no Kueue Workload for {kind} {js_name} yet; if this lasts, check that Kueue's {kind} integration "
            f"is enabled (integrations.frameworks: {FRAMEWORKS[kind]}), that LocalQueue {queue} exists and "
            f"that the {kind}'s WorkloadPriorityClass (label kueue.x-k8s.io/priority-class) exists"
        )
    conditions = {c.get("type"): c for c in workload.get("status", {}).get("conditions", []) or []}
    waiting = [c for c in admission_checks(workload) if c.get("state") != "Ready"]
    if waiting and jobset.condition(workload, "QuotaReserved") and not jobset.condition(workload, "Evicted"):
        return f"quota reserved, waiting for admission checks: {checks_line(waiting)}"
    for kind in ("Evicted", "QuotaReserved", "Admitted"):
        cond = conditions.get(kind)
        if cond and (kind == "Evicted") == (cond.get("status") == "True"):
            return f"{kind} {cond.get('status')}: {cond.get('reason')}: {cond.get('message')}"
    if jobset.condition(workload, "QuotaReserved"):
        return "quota reserved, waiting for admission checks"
    return f"Workload {workload['metadata']['name']} pending (no condition yet)"


#: Kueue messages of a QuotaReserved False condition that no wait resolves -> the fix (``{0}``: the name matched).
_BLOCKING_MESSAGES: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"LocalQueue (\S+) doesn't exist"),
        "run the provision step, which applies LocalQueue {0} in the run's namespace, or set `queue` to an "
        "existing LocalQueue",
    ),
    (
        re.compile(r"ClusterQueue (\S+) doesn't exist"),
        "a cluster admin applies ClusterQueue {0} from `multislice render` (kueue.yaml), or set "
        "service_accounts.kueue_cluster_objects: true so provision applies it",
    ),
    (
        re.compile(r"resource (\S+) unavailable in ClusterQueue"),
        "a pod set requests {0} and no resource group of the ClusterQueue covers it: apply the ClusterQueue and "
        "ResourceFlavors `multislice render` writes for this run's launcher (kueue-*.yaml; with `--set "
        f"launcher=ray` a second resource group, flavor {kueue.CPU_FLAVOR}, covers the RayJob head's and "
        "submitter's cpu and memory), or set `cluster_queue` to one that covers {0}",
    ),
    (
        re.compile(r"DeviceClass (\S+) is not mapped in DRA configuration"),
        "Kueue's Configuration maps no quota resource to DeviceClass {0}: merge "
        f"kueue-config/{kueue.KUEUE_CONFIG_KEY} from `multislice render` into ConfigMap "
        f"{kueue.KUEUE_CONFIG_NAMESPACE}/{kueue.KUEUE_CONFIG_MAP}, restart Kueue (kubectl -n "
        f"{kueue.KUEUE_CONFIG_NAMESPACE} rollout restart deployment kueue-controller-manager) and apply the rendered "
        f"ClusterQueue (its quota covers {kueue.DRANET_RESOURCE}); or drop node_pools.additional_node_networks",
    ),
    (
        re.compile(r"Workload uses DRA resources but the (\S+) feature gate is not enabled"),
        "enable Kueue's {0} feature gate (beta, on by default; remove the override from Kueue's Configuration "
        "featureGates or its --feature-gates flag) and restart Kueue; or drop node_pools.additional_node_networks",
    ),
]
#: The fix for a Rejected admission check (queued provisioning: the ProvisioningRequest failed past Kueue's retries).
_REJECTED_FIX = (
    "Dynamic Workload Scheduler could not provide the slices (the ProvisioningRequest failed after Kueue's retries, "
    "or its capacity was revoked): check flex-start TPU quota and availability in node_pools.zone (or try another "
    "zone), then rerun admit, which submits the workload again; `kubectl get provisioningrequests -n <namespace>` "
    "shows the request"
)
#: Warning event reasons on the JobSet that mean Kueue will create no Workload for it -> the fix.
_BLOCKING_EVENTS = {
    "WorkloadPriorityClassNotFound": (
        "set `priority` to an existing WorkloadPriorityClass, or have it applied (provision applies it with "
        "service_accounts.kueue_cluster_objects: true; otherwise a cluster admin, from `multislice render`)"
    ),
}


def jobset_events(kube: Kube, js_name: str, kind: str = "JobSet") -> list[Any]:
    """The events whose involved object is the JobSet (or the RayJob: ``kind``; ``V1Event``; empty when none)."""
    try:
        found = kube.call(
            kube.core.list_namespaced_event, kube.namespace,
            field_selector=f"involvedObject.kind={kind},involvedObject.name={js_name}",
            what=f"list events of {kind} {js_name}",
        )  # fmt: skip
    except ApiException:
        return []
    return list(found.items)


def blocked(kube: Kube, js_name: str, workload: dict[str, Any] | None, kind: str = "JobSet") -> tuple[str, str] | None:
    """``(cause, fix)`` when the JobSet cannot be admitted until something is changed, else None.

    Reads the Workload's admission checks (one Rejected: with queued provisioning, the ProvisioningRequest failed
    past Kueue's retries or its capacity was revoked) and QuotaReserved condition, and when there is no Workload,
    the JobSet's Warning events (the module docstring lists what is recognised and its sources).
    """
    if workload is not None:
        rejected = [c for c in admission_checks(workload) if c.get("state") == "Rejected"]
        if rejected:
            cause = f"Workload {workload['metadata']['name']}: {checks_line(rejected)}"
            return cause, _REJECTED_FIX
        cond = next(
            (c for c in workload.get("status", {}).get("conditions", []) or [] if c.get("type") == "QuotaReserved"),
            None,
        )
        if cond is None or cond.get("status") == "True":
            return None
        message = cond.get("message") or ""
        for pattern, fix in _BLOCKING_MESSAGES:
            match = pattern.search(message)
            if match:
                cause = f"Workload {workload['metadata']['name']}: QuotaReserved False: {cond.get('reason')}: {message}"
                return cause, fix.format(match.group(1))
        return None
    for event in reversed(jobset_events(kube, js_name, kind)):
        if event.type == "Warning" and event.reason in _BLOCKING_EVENTS:
            return f"{kind} {js_name} event {event.reason}: {event.message}", _BLOCKING_EVENTS[event.reason]
    return None


def admission(workload: dict[str, Any]) -> dict[str, Any]:
    """ClusterQueue and flavors of an admitted Workload: ``{"cluster_queue": str, "flavors": [str]}``."""
    status = workload.get("status", {}).get("admission", {}) or {}
    flavors: list[str] = []
    for assignment in status.get("podSetAssignments", []) or []:
        for flavor in (assignment.get("flavors") or {}).values():
            if flavor not in flavors:
                flavors.append(flavor)
    return {"cluster_queue": status.get("clusterQueue"), "flavors": flavors}


def wait_admitted(
    kube: Kube,
    js_name: str,
    queue: str,
    *,
    timeout: float,
    on_progress: Callable[[str], None],
    kind: str = "JobSet",
    get: Callable[[Kube, str], dict[str, Any] | None] | None = None,
) -> tuple[dict[str, Any], float]:
    """Wait until the JobSet's Workload has QuotaReserved and then Admitted, on watch events of the namespace's
    Workloads.

    Lists the Workloads, then watches from the list's resourceVersion (:func:`.watch.follow`: nothing between the
    two is missed; 410 Gone lists again), so each change Kueue makes wakes the wait at once. The JobSet is read,
    and its events listed while it has no Workload (:func:`blocked`), after each list and whenever a watch request
    ends idle (every ``min(watch_seconds, report_seconds)``) or the Workload is deleted: the API requests made are
    bounded by the changes and those intervals, not by a poll interval. Reports the pending reason every
    ``kube.timings.report_seconds`` and when it changes.

    Returns:
        ``(Workload, seconds waited)``.

    Raises:
        AdmissionTimeout: not admitted within ``timeout`` seconds (message: the last reason).
        AdmissionBlocked: Kueue cannot admit it as configured (:func:`blocked`): at once, with the cause and fix.
        WorkloadDeleted: the JobSet disappeared while waiting.
        multislice.backends.gke.retry.ApiUnavailable: the API kept failing past ``kube.timings.api_deadline``.

    ``kind`` and ``get`` (``get(kube, name)``) wait on another kind of workload (a RayJob) the same way.
    """
    started = time.monotonic()
    read = get or (lambda k, n: k.get_jobset(n))
    state: dict[str, Any] = {"reason": None, "report": 0.0, "workload": None}

    def owner() -> dict[str, Any]:
        js = read(kube, js_name)
        if js is None:
            raise WorkloadDeleted(f"{kind} {kube.namespace}/{js_name} was deleted while waiting for admission")
        js.setdefault("kind", kind)
        return js

    js = owner()

    def look(workload: dict[str, Any] | None, ask_api: bool) -> dict[str, Any] | None:
        """The Workload when admitted; else report, and raise when it is blocked."""
        if admitted(workload):
            return workload
        if workload is not None or ask_api:  # without a Workload, blocked() lists the JobSet's events
            stop = blocked(kube, js_name, workload, kind)
            if stop is not None:
                cause, fix = stop
                raise AdmissionBlocked(f"{kind} {js_name} cannot be admitted by Kueue: {cause}", fix)
        reason = pending_reason(workload, js_name, queue, kind)
        now = time.monotonic()
        if reason != state["reason"] or now - state["report"] >= kube.timings.report_seconds:
            on_progress(f"waiting for admission ({now - started:.0f} s): {reason}")
            state["reason"], state["report"] = reason, now
        return None

    events = watch.follow(
        kube, kube.custom.list_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, kube.namespace,
        WORKLOAD_PLURAL, what=f"Kueue Workloads of {kind} {js_name}", deadline=started + timeout,
        watch_seconds=min(kube.timings.watch_seconds, kube.timings.report_seconds), listed_marker=True,
    )  # fmt: skip
    current: dict[str, Any] | None = None
    listing: dict[str, Any] | None = None  # the Workload of the list being read
    for event, obj in events:
        if event == watch.LISTED and obj is not None:
            if owned_by(obj, js):
                listing = obj
            continue
        ask_api = event in (watch.LISTED, watch.IDLE)
        if event == watch.LISTED:  # the whole list seen: it holds the Workload, or there is none
            current, listing = listing, None
        elif obj is not None and owned_by(obj, js):
            current = None if event == "DELETED" else obj
            ask_api = event == "DELETED"
        elif event != watch.IDLE:
            continue  # another workload's change
        if ask_api:
            js = owner()
        found = look(current, ask_api)
        if found is not None:
            return found, time.monotonic() - started
    raise AdmissionTimeout(
        f"{kind} {js_name} not admitted by Kueue after {timeout:.0f} s; last reason: {state['reason']}",
        "raise the ClusterQueue's quota or free capacity, or wait longer (timeouts.admit)",
    )
