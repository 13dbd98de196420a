"""launch: wait until every pod of every slice is running, and check where they run.

The backend waits (:meth:`multislice.backends.base.Backend.wait_running`): on
GKE for all pods of the current restart attempt to be Running, with exclusive
placement checked from each pod's node's node-pool label, failing fast on
image-pull errors and crash loops and on pods Unschedulable past a grace
period (quoting the pod's events); locally for every pod process to start.
The report maps each pod to its slice, host and node (or process).
"""

from __future__ import annotations

import time
from typing import Any

from multislice import cancel
from multislice.backends import Backend
from multislice.backends.base import LaunchFailed
from multislice.plan import Plan, StagePlan
from multislice.reports import AdmitReport, LaunchReport
from multislice.steps import backend_of, cancellable, say, stage_labels, teller, write_report

__all__ = ["LaunchFailed", "run"]


def run(
    plan: Plan, stage: StagePlan, admitted: AdmitReport | dict[str, Any], *, backend: Backend | None = None
) -> LaunchReport:
    """Wait for all pods of the workload of ``stage`` (one of ``plan.stages``); returns the launch report with the
    placement map.

    ``admitted`` is the admit step's report (a dict when it comes from another
    component); a stage admit skipped is passed through.

    Raises:
        multislice.backends.base.LaunchFailed: the pods cannot all start, or not within ``timings.launch_timeout``
            (the message says why and what to check).
        multislice.backends.base.WorkloadDeleted: the workload was deleted while waiting.
    """
    admitted = AdmitReport.model_validate(admitted)
    if admitted.skipped:
        return write_report(plan, LaunchReport(workload=stage.workload, skipped=True), stage)
    with cancellable("launch", stage, stage_labels(plan, stage, admitted.pipeline_run_id), plan) as removal:
        removal.backend = backend = backend_of(plan, backend, "launch", stage)
        started = time.monotonic()
        with backend.holding(stage.workload, "launch", teller("launch", stage)):
            cancel.point("launch:waiting")
            running = backend.wait_running(plan, stage, teller("launch", stage))
        report = LaunchReport(
            workload=stage.workload,
            pods=len(running.placement),
            startup_seconds=round(time.monotonic() - started, 2),
            placement=running.placement,
            node_pools=running.node_pools,
            note=running.note,
        )
        cancel.point("launch:report")
        where = (
            f"on node pools {', '.join(report.node_pools)}"
            if report.node_pools
            else f"({plan.spec.num_slices} slices x {plan.slice.hosts} hosts)"
        )
        say("launch", f"{report.pods} pods running {where} after {report.startup_seconds} s", stage.name)
        return write_report(plan, report, stage)
