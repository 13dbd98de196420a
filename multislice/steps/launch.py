"""launch: wait until every pod of every slice is running, and check where they run.

On GKE this will wait for all pods Running and check exclusive placement
(each child Job on one node pool, different Jobs on different pools), failing
fast on image-pull and crash loops (not built yet). On the local backend each
pod is a process of this machine; launch waits for all of them to start and
reports the placement: which process stands for which host of which slice.
"""

from __future__ import annotations

import time
from typing import Any

from multislice.backends import backend_for
from multislice.backends.local.state import JobSetState
from multislice.plan import Plan
from multislice.steps import say, write_report

STARTUP_TIMEOUT_SECONDS = 300


class LaunchFailed(RuntimeError):
    """The JobSet ended before all its pods ran; the message holds the reason and the pods' exits."""


def _all_running(state: JobSetState) -> bool:
    return state.phase == "Running" and bool(state.pods) and all(p.phase == "Running" for p in state.pods)


def run(plan: Plan, stage_name: str, admitted: dict[str, Any]) -> dict[str, Any]:
    """Wait for all pods of the stage's JobSet; returns the launch report with the placement map.

    ``admitted`` is the admit step's report; a stage admit skipped is passed through.

    Raises:
        LaunchFailed: the JobSet failed or was deleted before all pods ran.
        TimeoutError: pods not all running within 300 s.
    """
    stage = plan.stage(stage_name)
    if admitted.get("skipped"):
        return write_report(plan, "launch", {"jobset": stage.jobset, "skipped": True}, stage)
    backend = backend_for(plan.spec.backend, plan.run_dir)
    started = time.monotonic()
    state = backend.wait(stage.jobset, _all_running, timeout=STARTUP_TIMEOUT_SECONDS, poll=0.2)
    if state.phase == "Completed":
        pass  # finished before we looked: every pod ran
    elif not _all_running(state):
        exits = ", ".join(f"{p.hostname} exit {p.exit_code}" for p in state.pods if p.exit_code is not None)
        raise LaunchFailed(
            f"JobSet {stage.jobset} is {state.phase} ({state.reason}: {state.message}) before all pods ran; {exits}"
        )
    expected = plan.spec.num_slices * plan.slice["hosts"]
    placement = {
        p.hostname: {"slice": p.job_index, "host": p.completion_index, "node": "localhost", "pid": p.pid}
        for p in state.pods
    }
    slices = {p["slice"] for p in placement.values()}
    if len(placement) != expected or len(slices) != plan.spec.num_slices:
        raise LaunchFailed(
            f"JobSet {stage.jobset} runs {len(placement)} pods in {len(slices)} slices; the plan has "
            f"{plan.spec.num_slices} slices x {plan.slice['hosts']} hosts"
        )
    report = {
        "jobset": stage.jobset,
        "skipped": False,
        "pods": len(placement),
        "startup_seconds": round(time.monotonic() - started, 2),
        "placement": placement,
        "note": "local backend: every pod is a process on this machine; "
        "a slice is the set of processes of one child Job",
    }
    say(
        "launch",
        f"{len(placement)} pods running ({plan.spec.num_slices} slices x {plan.slice['hosts']} hosts) "
        f"after {report['startup_seconds']} s",
        stage.name,
    )
    return write_report(plan, "launch", report, stage)
