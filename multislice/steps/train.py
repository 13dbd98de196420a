"""train: follow a stage's training to its end and report MaxText's metrics.

Follows the leader pod's log (slice 0, host 0; a new attempt's log after each
JobSet restart), echoing MaxText's step lines and the JobSet's events, until
the JobSet completes or fails. On completion it summarises MaxText's
per-step metrics (:mod:`multislice.metrics`); on failure it raises with the
JobSet's reason, each failed pod's exit code and the last lines of its log.
On SIGTERM (the pipeline run was cancelled) it deletes the JobSet before
exiting, so no pod outlives the run.

On GKE the leader's log is read through the Kubernetes API (re-attached after
each JobSet restart), MaxText's step lines are parsed into the same metrics
records (:func:`multislice.metrics.parse_step_line`), and the JobSet is
watched (re-listed after 410 Gone) for Completed, Failed, restarts and
Kueue evictions (the JobSet suspended again), which are reported while it
waits to be admitted again.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

from multislice import metrics
from multislice.backends import backend_for
from multislice.backends.local import LocalBackend
from multislice.backends.local.state import JobSetState
from multislice.plan import Plan
from multislice.steps import gke_api, is_local_path, report_path, say, write_report

#: Log lines worth echoing from the leader: MaxText's step lines, the worker's and the mesh.
ECHO = re.compile(
    r"completed step:|multislice worker:|emulated multislice mesh|Num_devices: \d|"
    r"restoring from this run's directory step|No existing checkpoints found"
)
TRAIN_TIMEOUT_SECONDS = 6 * 3600
TAIL_LINES = 25


class TrainingFailed(RuntimeError):
    """The stage's JobSet failed; the message holds the reason, the pods' exit codes and log tails."""


class _Cancelled(BaseException):
    pass


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a file ('' when missing)."""
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


class _LogFollower:
    """Echo new matching lines of the leader's log, across restart attempts."""

    def __init__(self, backend: LocalBackend, jobset: str, stage: str):
        self.backend, self.jobset, self.stage = backend, jobset, stage
        self.attempt = -1
        self.offset = 0
        self.events_seen = 0

    def poll(self, state: JobSetState) -> None:
        for event in state.events[self.events_seen :]:
            say("train", f"JobSet event {event.reason}: {event.message}", self.stage)
        self.events_seen = len(state.events)
        if state.restarts != self.attempt:
            self.attempt, self.offset = state.restarts, 0
        path = self.backend.pod_log(self.jobset, 0, 0, self.attempt)
        try:
            with open(path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return
        complete = chunk.rfind(b"\n") + 1
        self.offset += complete
        for line in chunk[:complete].decode("utf-8", errors="replace").splitlines():
            if ECHO.search(line):
                say("train", line.split("] ", 1)[-1].strip(), self.stage)


def _failure_message(backend: LocalBackend, state: JobSetState) -> str:
    lines = [f"JobSet {state.name} {state.phase}: {state.reason}: {state.message} (restarts: {state.restarts})"]
    for pod in state.pods:
        if pod.phase == "Failed" or (pod.exit_code not in (None, 0)):
            lines.append(
                f"pod {pod.hostname} (slice {pod.job_index}, host {pod.completion_index}) exit code "
                f"{pod.exit_code}; last log lines ({pod.log}):"
            )
            lines.append(tail(Path(pod.log)))
    return "\n".join(lines)


def run(
    plan: Plan,
    stage_name: str,
    admitted: dict[str, Any],
    timeout: float = TRAIN_TIMEOUT_SECONDS,
    *,
    kube: Any = None,
    timings: Any = None,
) -> dict[str, Any]:
    """Wait for the stage's training and summarise it; returns the train report.

    ``admitted`` is the admit step's report; a stage admit skipped is passed through.

    Report keys: ``steps_trained`` (distinct steps with metrics), ``first_loss``,
    ``final_loss``, ``step_time_seconds``, ``tokens_per_second_per_device``,
    ``tflops_per_second_per_device``, ``restarts``, ``wall_seconds``.

    Raises:
        TrainingFailed: the JobSet failed or was deleted.
        TimeoutError: still running after ``timeout`` seconds (GKE: ``timings.train_timeout``).
    """
    stage = plan.stage(stage_name)
    if admitted.get("skipped"):
        return write_report(plan, "train", {"jobset": stage.jobset, "skipped": True}, stage)
    if plan.spec.backend == "gke":
        return _run_gke(plan, stage_name, gke_api(plan, "train", stage, kube, timings))
    backend = backend_for(plan.spec.backend, plan.run_dir)
    follower = _LogFollower(backend, stage.jobset, stage.name)
    started = time.monotonic()

    def cancel(signum: int, frame: Any) -> None:
        raise _Cancelled()

    previous = signal.signal(signal.SIGTERM, cancel)
    try:
        state = backend.wait(stage.jobset, lambda s: s.terminal, timeout=timeout, poll=1.0, on_poll=follower.poll)
    except _Cancelled:
        say("train", f"cancelled: deleting JobSet {stage.jobset}", stage.name)
        backend.delete_jobset(stage.jobset)
        raise TrainingFailed(f"training of {stage.name} was cancelled; JobSet {stage.jobset} deleted") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    follower.poll(state)
    if state.phase != "Completed":
        raise TrainingFailed(_failure_message(backend, state))
    summary = metrics.summarize(metrics.read_records(stage.metrics_file))
    report = {
        "jobset": stage.jobset,
        "skipped": False,
        "steps_trained": summary.steps_recorded,
        "restarts": state.restarts,
        "wall_seconds": round(time.monotonic() - started, 1),
        **summary.as_dict(),
        "metrics_file": stage.metrics_file,
        "leader_log": str(backend.pod_log(stage.jobset, 0, 0)),
    }
    say(
        "train",
        f"completed {summary.steps_recorded} steps, loss {summary.first_loss:.3f} -> {summary.final_loss:.3f}, "
        f"{summary.tokens_per_second_per_device:.0f} tokens/s/device, restarts {state.restarts}",
        stage.name,
    )
    return write_report(plan, "train", report, stage)


def _gke_failure_message(kube: Any, js: dict[str, Any]) -> str:
    from multislice.backends.gke import jobset as jobsets
    from multislice.backends.gke import logs, pods

    name = js["metadata"]["name"]
    lines = [f"JobSet {name} {jobsets.describe(js)}"]
    for pod in pods.list_pods(kube, name):
        code = pods.exit_code(pod)
        if pod.status.phase == "Failed" or code not in (None, 0):
            lines.append(
                f"pod {pod.metadata.name} (slice {pods.slice_index(pod)}, host {pods.host_index(pod)}, attempt "
                f"{pods.attempt(pod)}) exit code {code}; last log lines:"
            )
            lines.append(logs.tail(kube, pod.metadata.name, TAIL_LINES))
    return "\n".join(lines)


def _run_gke(plan: Plan, stage_name: str, kube: Any) -> dict[str, Any]:
    from multislice.backends.gke import jobset as jobsets
    from multislice.backends.gke import logs, watch, workload
    from multislice.backends.gke.client import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION

    stage = plan.stage(stage_name)
    timings = kube.timings
    records: list[dict[str, Any]] = []

    def on_line(pod: str, line: str) -> None:
        record = metrics.parse_step_line(line)
        if record:
            records.append(record)
        if ECHO.search(line):
            say("train", line.split("] ", 1)[-1].strip(), stage.name)

    def tell(message: str) -> None:
        say("train", message, stage.name)

    follower = logs.LeaderLog(kube, stage.jobset, on_line, timings.poll_seconds)
    follower.start()
    started = time.monotonic()
    seen_restarts, suspended_since, final = 0, None, None

    def cancel(signum: int, frame: Any) -> None:
        raise _Cancelled()

    previous = signal.signal(signal.SIGTERM, cancel)
    try:
        events = watch.follow(
            kube, kube.custom.list_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, kube.namespace,
            JOBSET_PLURAL, field_selector=f"metadata.name={stage.jobset}", what=f"JobSet {stage.jobset}",
            deadline=started + timings.train_timeout, on_relist=tell,
        )  # fmt: skip
        for kind, js in events:
            if kind == watch.IDLE:
                js = kube.get_jobset(stage.jobset)
                if js is None:
                    kind = "DELETED"
            if kind == "DELETED":
                raise TrainingFailed(f"JobSet {stage.jobset} was deleted during training")
            state = jobsets.phase(js)
            if jobsets.restarts(js) != seen_restarts:
                seen_restarts = jobsets.restarts(js)
                tell(f"JobSet restarted ({seen_restarts}/{plan.spec.max_restarts} restarts); following the new leader")
            if state == "Suspended":
                if suspended_since is None:
                    suspended_since = time.monotonic()
                    reason = workload.pending_reason(workload.find(kube, js), stage.jobset, plan.spec.queue)
                    tell(f"JobSet suspended by Kueue ({reason}); waiting to be admitted again")
                elif time.monotonic() - suspended_since > timings.readmit_timeout:
                    raise TrainingFailed(
                        f"JobSet {stage.jobset} evicted and not admitted again within {timings.readmit_timeout:.0f} s"
                    )
            elif suspended_since is not None:
                tell(f"JobSet admitted again after {time.monotonic() - suspended_since:.0f} s; training resumes")
                suspended_since = None
            if state in ("Completed", "Failed"):
                final = js
                break
    except _Cancelled:
        tell(f"cancelled: deleting JobSet {stage.jobset}")
        jobsets.delete(kube, stage.jobset)
        raise TrainingFailed(f"training of {stage.name} was cancelled; JobSet {stage.jobset} deleted") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        follower.stop()
    if final is None:
        raise TimeoutError(f"JobSet {stage.jobset} still running after {timings.train_timeout:.0f} s")
    follower.join(timeout=timings.poll_seconds * 4 + 5)
    follower.catch_up()
    if jobsets.phase(final) != "Completed":
        raise TrainingFailed(_gke_failure_message(kube, final))
    summary = metrics.summarize(records)
    report = {
        "jobset": stage.jobset,
        "skipped": False,
        "steps_trained": summary.steps_recorded,
        "restarts": jobsets.restarts(final),
        "wall_seconds": round(time.monotonic() - started, 1),
        **summary.as_dict(),
        "leader_pods": follower.pods_followed,
    }
    tell(
        f"completed {summary.steps_recorded} steps, loss {summary.first_loss:.3f} -> {summary.final_loss:.3f}, "
        f"{summary.tokens_per_second_per_device:.0f} tokens/s/device, restarts {report['restarts']}"
    )
    return write_report(plan, "train", report, stage)


def result_pages(plan: Plan, stage_name: str, report: dict[str, Any]) -> dict[str, str]:
    """The stage's pages for the pipelines UI: ``{"html": loss and step-time plots, "markdown": run summary}``.

    Built from the train report and MaxText's per-step metrics file it names
    (:mod:`multislice.delivery.artifacts`); for a local run directory they are also
    written to ``<run_dir>/reports/<stage>/train.html`` and ``train.md``.
    """
    from multislice.delivery import artifacts

    stage = plan.stage(stage_name)
    text = artifacts.train_markdown(stage.name, report)
    metrics_file = report.get("metrics_file")
    if report.get("skipped"):
        page = artifacts.html_page(f"train {stage.name}", f"<p>{text.splitlines()[-1]}</p>")
    elif metrics_file and is_local_path(metrics_file):
        page = artifacts.train_html(stage.name, report, metrics.read_records(metrics_file))
    else:  # the GKE path reads step lines from the leader's log and keeps no metrics file here: no plot yet
        page = artifacts.html_page(f"train {stage.name}", artifacts.html_table([report], artifacts.TRAIN_COLUMNS))
    if is_local_path(plan.run_dir):
        directory = report_path(plan, "train", stage).parent
        artifacts.write_text(directory / "train.html", page)
        artifacts.write_text(directory / "train.md", text)
    return {"html": page, "markdown": text}
