"""launch: wait until every pod of every slice is running, and check where they run.

On GKE it waits for all pods of the current restart attempt to be Running
and checks exclusive placement from each pod's node's node-pool label (each
child Job on one node pool, different Jobs on different pools); it fails
fast on image-pull errors and crash loops, and on pods Unschedulable past a
grace period, quoting the pod's events. On the local backend each
pod is a process of this machine; launch waits for all of them to start and
reports the placement: which process stands for which host of which slice.
"""

from __future__ import annotations

import time
from typing import Any

from multislice.backends import backend_for
from multislice.backends.local.state import JobSetState
from multislice.plan import Plan
from multislice.steps import gke_api, say, write_report

STARTUP_TIMEOUT_SECONDS = 300


class LaunchFailed(RuntimeError):
    """The JobSet ended before all its pods ran; the message holds the reason and the pods' exits."""


def _all_running(state: JobSetState) -> bool:
    return state.phase == "Running" and bool(state.pods) and all(p.phase == "Running" for p in state.pods)


def _report(jobset: str, placement: dict[str, Any], started: float, **extra: Any) -> dict[str, Any]:
    """The launch report: pods, seconds from ``started`` (``time.monotonic()``) to all running, placement."""
    return {
        "jobset": jobset,
        "skipped": False,
        "pods": len(placement),
        "startup_seconds": round(time.monotonic() - started, 2),
        "placement": placement,
        **extra,
    }


def run(
    plan: Plan, stage_name: str, admitted: dict[str, Any], *, kube: Any = None, timings: Any = None
) -> dict[str, Any]:
    """Wait for all pods of the stage's JobSet; returns the launch report with the placement map.

    ``admitted`` is the admit step's report; a stage admit skipped is passed through.
    Report keys: ``jobset``, ``skipped``, ``pods``, ``startup_seconds``, ``placement``
    (pod -> slice, host, node[, node_pool]).

    Raises:
        LaunchFailed: the JobSet failed or was deleted before all pods ran; (GKE) a pod cannot pull its
            image or crash-loops, stays Unschedulable past ``timings.unschedulable_grace``, or placement
            is not exclusive.
        TimeoutError: pods not all running within 300 s (local) or ``timings.launch_timeout`` (GKE).
    """
    stage = plan.stage(stage_name)
    if admitted.get("skipped"):
        return write_report(plan, "launch", {"jobset": stage.jobset, "skipped": True}, stage)
    if plan.spec.backend == "gke":
        return _run_gke(plan, stage_name, gke_api(plan, "launch", stage, kube, timings))
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
    report = _report(
        stage.jobset, placement, started,
        note="local backend: every pod is a process on this machine; a slice is the set of processes of one child Job",
    )  # fmt: skip
    say(
        "launch",
        f"{len(placement)} pods running ({plan.spec.num_slices} slices x {plan.slice['hosts']} hosts) "
        f"after {report['startup_seconds']} s",
        stage.name,
    )
    return write_report(plan, "launch", report, stage)


def _pod_line(kube: Any, pod: Any, cause: str) -> str:
    from multislice.backends.gke import pods

    events = pods.events(kube, pod.metadata.name)
    return f"pod {pod.metadata.name} (slice {pods.slice_index(pod)}, host {pods.host_index(pod)}) {cause}" + (
        f"; its events:\n{events}" if events else ""
    )


def _run_gke(plan: Plan, stage_name: str, kube: Any) -> dict[str, Any]:
    from multislice.backends.gke import jobset as jobsets
    from multislice.backends.gke import pods

    stage = plan.stage(stage_name)
    timings = kube.timings
    expected = plan.spec.num_slices * plan.slice["hosts"]
    started = time.monotonic()
    unschedulable_since: dict[str, float] = {}
    last_report = 0.0
    while True:
        js = kube.get_jobset(stage.jobset)
        if js is None:
            raise LaunchFailed(f"JobSet {stage.jobset} was deleted before all its pods ran")
        state = jobsets.phase(js)
        if state == "Failed":
            raise LaunchFailed(f"JobSet {stage.jobset} failed before all its pods ran: {jobsets.describe(js)}")
        current = pods.list_pods(kube, stage.jobset, jobsets.restarts(js))
        now = time.monotonic()
        for pod in current:
            problem = pods.waiting_problem(pod)
            if problem:
                raise LaunchFailed(
                    _pod_line(kube, pod, f"cannot start: {problem}")
                    + f"\nCheck the image reference {plan.spec.images.trainer!r} and that the nodes may pull it "
                    "(Artifact Registry reader role for the node service account)"
                )
            message = pods.unschedulable(pod)
            if message is None:
                unschedulable_since.pop(pod.metadata.name, None)
                continue
            since = unschedulable_since.setdefault(pod.metadata.name, now)
            if now - since > timings.unschedulable_grace:
                raise LaunchFailed(
                    _pod_line(kube, pod, f"Unschedulable for {now - since:.0f} s: {message}")
                    + f"\nCheck that {plan.spec.num_slices} TPU node pools of {plan.slice['name']} "
                    f"(topology {plan.slice['topology']}, {plan.slice['machine_type']}) exist and are ready"
                )
        running = [p for p in current if p.status.phase == "Running"]
        if state == "Completed" or (state == "Running" and len(running) == expected):
            break
        if now - last_report >= timings.report_seconds:
            waiting = sorted({pods.unschedulable(p) or p.status.phase for p in current if p not in running})
            say("launch", f"{len(running)}/{expected} pods Running; JobSet {state}; others: {waiting}", stage.name)
            last_report = now
        if now - started > timings.launch_timeout:
            raise TimeoutError(
                f"JobSet {stage.jobset}: {len(running)}/{expected} pods Running after {timings.launch_timeout:.0f} s"
            )
        time.sleep(timings.poll_seconds)
    placement = pods.placement(kube, running)
    problems = pods.exclusive_placement_problems(placement) if state != "Completed" else []
    if problems:
        raise LaunchFailed(
            f"JobSet {stage.jobset} is not placed one slice per node pool: {'; '.join(problems)}. Check the "
            "JobSet's exclusive-topology annotation and that JobSet's webhook is installed"
        )
    report = _report(
        stage.jobset, placement, started, node_pools=sorted({str(p["node_pool"]) for p in placement.values()})
    )
    say(
        "launch",
        f"{len(placement)} pods running on node pools {', '.join(report['node_pools'])} "
        f"after {report['startup_seconds']} s",
        stage.name,
    )
    return write_report(plan, "launch", report, stage)
