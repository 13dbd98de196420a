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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from multislice.backends.base import AdmissionTimeout, WorkloadDeleted
from multislice.backends.gke import jobset
from multislice.backends.gke.client import Kube


def owned_by(workload: dict[str, Any], js: dict[str, Any]) -> bool:
    """True when the Workload's owner references name this JobSet (by uid when both have one)."""
    uid = js["metadata"].get("uid")
    for ref in workload.get("metadata", {}).get("ownerReferences", []) or []:
        if ref.get("kind") == "JobSet" and ref.get("name") == js["metadata"]["name"]:
            if not uid or not ref.get("uid") or ref["uid"] == uid:
                return True
    return False


def find(kube: Kube, js: dict[str, Any]) -> dict[str, Any] | None:
    """The Workload Kueue created for the JobSet, or None (not yet)."""
    for item in kube.list_workloads():
        if owned_by(item, js):
            return item
    return None


def admitted(workload: dict[str, Any] | None) -> bool:
    """True when the Workload is Admitted and not Evicted."""
    return bool(workload) and bool(jobset.condition(workload, "Admitted")) and not jobset.condition(workload, "Evicted")


def pending_reason(workload: dict[str, Any] | None, js_name: str, queue: str) -> str:
    """Why the Workload is not admitted, from its conditions (most telling first)."""
    if workload is None:
        return (
            f"no Kueue Workload for JobSet {js_name} yet; if this lasts, check that Kueue's JobSet integration "
            f"is enabled (integrations.frameworks: jobset.x-k8s.io/jobset) and that LocalQueue {queue} exists"
        )
    conditions = {c.get("type"): c for c in workload.get("status", {}).get("conditions", []) or []}
    for kind in ("Evicted", "QuotaReserved", "Admitted"):
        cond = conditions.get(kind)
        if cond and (kind == "Evicted") == (cond.get("status") == "True"):
            return f"{kind} {cond.get('status')}: {cond.get('reason')}: {cond.get('message')}"
    if jobset.condition(workload, "QuotaReserved"):
        return "quota reserved, waiting for admission checks"
    return f"Workload {workload['metadata']['name']} pending (no condition yet)"


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
) -> tuple[dict[str, Any], float]:
    """Wait until the JobSet's Workload has QuotaReserved and then Admitted.

    Reports the pending reason every ``kube.timings.report_seconds`` and when it changes.

    Returns:
        ``(Workload, seconds waited)``.

    Raises:
        AdmissionTimeout: not admitted within ``timeout`` seconds (message: the last reason).
        WorkloadDeleted: the JobSet disappeared while waiting.
    """
    started = time.monotonic()
    last_reason, last_report = None, 0.0
    while True:
        js = kube.get_jobset(js_name)
        if js is None:
            raise WorkloadDeleted(f"JobSet {kube.namespace}/{js_name} was deleted while waiting for admission")
        workload = find(kube, js)
        if admitted(workload):
            return workload, time.monotonic() - started
        reason = pending_reason(workload, js_name, queue)
        now = time.monotonic()
        if reason != last_reason or now - last_report >= kube.timings.report_seconds:
            on_progress(f"waiting for admission ({now - started:.0f} s): {reason}")
            last_reason, last_report = reason, now
        if now - started > timeout:
            raise AdmissionTimeout(
                f"JobSet {js_name} not admitted by Kueue after {timeout:.0f} s; last reason: {reason}",
                "raise the ClusterQueue's quota or free capacity, or wait longer (timeouts.admit)",
            )
        time.sleep(kube.timings.poll_seconds)
