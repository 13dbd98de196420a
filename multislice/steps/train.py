"""train: follow a stage's training to its end and report MaxText's metrics.

The backend follows the workload (:meth:`multislice.backends.base.Backend.follow`):
the leader pod's log (slice 0, host 0; a new attempt's after each JobSet
restart) line by line, and what happens to the workload (restarts, Kueue
evictions and re-admission). This step turns MaxText's step lines into
metrics records (:func:`multislice.metrics.parse_step_line`), echoes the
lines worth seeing, and on completion summarises them
(:func:`multislice.metrics.summarize`) and writes the records to the run
directory (``<stage>/metrics.jsonl``, local or ``gs://``), from which the UI
pages plot the loss and step time. On failure it raises with the backend's
failure report (the reason, each failed pod's exit code and the last lines of
its log). On SIGTERM (the pipeline run was cancelled) it deletes the workload
before exiting, so no pod outlives the run.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

from multislice import cancel, elastic, metrics, storage
from multislice.backends import Backend
from multislice.backends.base import Finished, TrainingFailed
from multislice.delivery import artifacts
from multislice.plan import Plan, StagePlan
from multislice.preflight import on_slices
from multislice.reports import AdmitReport, TrainReport, report_path
from multislice.steps import backend_of, cancellable, stage_labels, teller, write_report

__all__ = ["ECHO", "TrainingFailed", "result_pages", "run"]

#: The worker's first line: a new attempt's leader log starts with it.
WORKER_START = re.compile(r"multislice worker: process \d+ ")

#: Log lines worth echoing from the leader: MaxText's step lines, the worker's and the mesh.
ECHO = re.compile(
    r"completed step:|Completed eval after|multislice worker:|multislice ray (worker|driver):|"
    r"emulated multislice mesh|Num_devices: \d|"
    r"restoring from this run's directory step|No existing checkpoints found"
)


def run(
    plan: Plan,
    stage_name: str,
    admitted: AdmitReport | dict[str, Any],
    *,
    backend: Backend | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> TrainReport:
    """Follow the stage's training and summarise it; returns the train report.

    ``admitted`` is the admit step's report (a dict when it comes from another
    component); a stage admit skipped is passed through. ``on_record`` is called
    with each step's metrics record as it is logged (tests, fault injection).

    An elastic stage (``elastic`` in the spec) on a backend that resizes
    (:attr:`~multislice.backends.base.Backend.elastic`) is followed by
    :func:`follow_elastic`: lost slices shrink it, returning capacity grows it back.

    Raises:
        multislice.backends.base.TrainingFailed: the workload failed, the run was cancelled, or it still ran after
            ``timings.train_timeout``.
        multislice.backends.base.WorkloadDeleted: the workload was deleted during training.
    """
    stage = plan.stage(stage_name)
    admitted = AdmitReport.model_validate(admitted)
    with cancellable("train", stage, stage_labels(plan, stage, admitted.pipeline_run_id), plan) as removal:
        if admitted.skipped:
            return write_report(plan, TrainReport(jobset=stage.jobset, skipped=True), stage)
        removal.backend = backend = backend_of(plan, backend, "train", stage)
        tell = teller("train", stage)
        records: list[dict[str, Any]] = []
        compiles: list[dict[str, Any]] = []  # the leader's XLA compiles, each attempt's in turn
        attempt = [-1]

        def on_line(line: str, hook: bool = True) -> None:
            if WORKER_START.search(line):
                attempt[0] += 1
            if compiled := metrics.parse_compile_line(line):
                compiles.append({"attempt": max(attempt[0], 0), **compiled})
            record = metrics.parse_step_line(line) or metrics.parse_eval_line(line)
            if record:
                records.append(record)
                if hook and on_record is not None:
                    on_record(record)
                cancel.point("train:following")
            if ECHO.search(line):
                tell(line.split("] ", 1)[-1].strip())

        started = time.monotonic()
        resizes: list[elastic.Resize] = []
        with (
            backend.deleting_on_cancel(stage.jobset, tell, removal.labels),
            backend.holding(stage.jobset, "train", tell),
        ):
            if stage.elastic and backend.elastic:
                finished = follow_elastic(
                    plan, stage, backend, records, lambda line: on_line(line, hook=False), tell, resizes, on_record
                )
            else:
                if stage.elastic:
                    tell(f"the {backend.name} backend does not resize workloads yet: training on a fixed size")
                finished = backend.follow(plan, stage, on_line, tell)
        if finished.phase != "Completed":
            raise TrainingFailed(
                backend.failure_report(stage.jobset),
                "fix the cause in the log lines above, then rerun with the same run_name: training resumes from the "
                "stage's last committed checkpoint",
            )
        if not records:
            raise TrainingFailed(
                f"JobSet {stage.jobset} completed, but its leader logged no MaxText step line",
                f"read the leader's log ({', '.join(finished.leader_logs) or 'none found'})",
            )
        cancel.point("train:report")
        summary = metrics.summarize(records)
        storage.write_text(stage.metrics_file, "".join(json.dumps(r) + "\n" for r in records))
        measured = summary.as_dict() | metrics.summarize_eval(records)
        wall = time.monotonic() - started
        fields: dict[str, Any] = {}
        if stage.elastic:
            steps = [r for r in records if "step" in r]  # eval records (eval_after_step) are not steps
            value, lost = elastic.goodput(steps, wall)
            fields = {
                "goodput": round(value, 4),
                "steps_lost": lost,
                "resizes": resizes,
                "slice_timeline": elastic.slice_timeline(steps),
                "global_batch_size": stage.global_batch_size,
            }
        report = TrainReport(
            jobset=stage.jobset,
            steps_trained=measured.pop("steps_recorded"),
            restarts=finished.restarts,
            restart_causes=finished.restart_causes,
            wall_seconds=round(wall, 1),
            **measured,
            metrics_file=stage.metrics_file,
            leader_logs=finished.leader_logs,
            compiles=compiles,
            **fields,
            launcher=stage.launcher,
        )
        tell(
            f"completed {summary.steps_recorded} steps, loss {summary.first_loss:.3f} -> {summary.final_loss:.3f}, "
            f"{summary.tokens_per_second_per_device:.0f} tokens/s/device, restarts {finished.restarts} "
            f"(launcher {stage.launcher})"
            + (
                f"; eval loss {report.first_eval_loss:.3f} -> {report.final_eval_loss:.3f} "
                f"(perplexity {report.final_eval_perplexity:.1f}, {report.evals} evals)"
                if report.evals
                else ""
            )
            + (
                "; XLA compile per attempt: "
                + ", ".join(f"{t:.1f} s ({hits}/{count} from the cache)" for t, hits, count in by_attempt)
                if (by_attempt := metrics.compile_seconds_by_attempt(compiles))
                else ""
            )
        )
        return write_report(plan, report, stage)


class _Watch:
    """What :func:`follow_elastic` observes of one workload between polls, and the decision it reaches."""

    def __init__(self, plan, stage, backend, running, runnable, wait_seconds, tell, records):
        self.plan, self.stage, self.backend, self.tell, self.records = plan, stage, backend, tell, records
        self.running, self.runnable, self.wait_seconds = running, runnable, wait_seconds
        self.lost_at: float | None = None
        self.capacity_at: float | None = None
        self.checkpoint_then: int | None = None
        self.checkpoint_at_decision: int | None = None
        self.decision: elastic.Decision | None = None
        self.detected = 0.0

    def interrupt(self) -> bool:
        """Observe, decide (:func:`multislice.elastic.decide`); True to stop following and relaunch."""
        now = time.monotonic()
        lost = self.backend.lost_slice(self.stage.jobset)
        available = self.backend.available_slices(self.plan) or 0
        if lost and self.lost_at is None:
            self.lost_at = now
            self.tell(f"slice lost: {lost}; waiting up to {self.wait_seconds:g} s for its capacity")
        elif not lost:
            self.lost_at = None
        latest = storage.latest_committed_step(self.stage.checkpoint_dir)
        if available > self.running and self.capacity_at is None:
            self.capacity_at, self.checkpoint_then = now, latest
            self.tell(f"capacity for {available} slice(s) available; growing back at the next checkpoint")
        elif available <= self.running:
            self.capacity_at = None
        then = -1 if self.checkpoint_then is None else self.checkpoint_then
        # Grow back at a checkpoint whose own step line has been read: MaxText prints a step's metrics one step
        # late, so relaunching as soon as checkpoint S commits would leave step S's loss unlogged (the verifier's
        # final_loss check reads the last steps' losses).
        logged = max((int(r["step"]) for r in self.records if "step" in r), default=-1)
        since = self.capacity_at is not None and latest is not None and latest > then and logged >= latest
        decision = elastic.decide(
            self.runnable,
            running=self.running,
            lost_at=self.lost_at,
            available=available,
            now=now,
            wait_seconds=self.wait_seconds,
            checkpoint_since_capacity=since,
        )
        if decision.action == "relaunch" and decision.slices != self.running:
            self.decision, self.detected = decision, self.lost_at or self.capacity_at or now
            self.checkpoint_at_decision = latest
            return True
        return False


def follow_elastic(
    plan: Plan,
    stage: StagePlan,
    backend: Backend,
    records: list[dict[str, Any]],
    on_line: Callable[[str], None],
    tell: Callable[[str], None],
    resizes: list[elastic.Resize],
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> Finished:
    """Follow an elastic stage to its end, relaunching it on fewer or more slices as :func:`multislice.elastic.decide`
    says; each step record gets ``slices`` (the count it was trained on) and each resize is appended to ``resizes``.

    After each poll of the workload it observes: whether the workload lost a slice and waits for its capacity
    (:meth:`~multislice.backends.base.Backend.lost_slice`), how many slices are available
    (:meth:`~multislice.backends.base.Backend.available_slices`) and the latest committed checkpoint (growing back
    waits for one committed after the capacity returned). A relaunch
    (:meth:`~multislice.backends.base.Backend.relaunch`) deletes the workload and creates it for the new count with
    its gradient accumulation (:func:`multislice.preflight.on_slices`); MaxText resumes from the latest committed
    checkpoint and Orbax restores it onto the new mesh. Returns how the last workload ended (``restarts`` summed over
    every workload).
    """
    runnable = stage.runnable_counts()
    wait_seconds = stage.wait_for_lost_slice_seconds or 0.0
    started = time.monotonic()
    current: dict[str, Any] = {"slices": runnable[0], "restarts": 0, "causes": []}
    pending: dict[str, elastic.Resize | None] = {"resize": None}

    def tagged(line: str) -> None:
        before = len(records)
        on_line(line)
        for record in records[before:]:
            record["slices"] = current["slices"]
            resize = pending["resize"]
            if resize is not None and "step" in record:  # a step record (eval records have eval_after_step)
                resize.resumed_at_seconds = round(time.monotonic() - started, 1)
                resize.resumed_from_step = int(record["step"]) - 1
                if resize.last_step_before is not None:
                    resize.steps_lost = max(0, resize.last_step_before - resize.resumed_from_step)
                resize.cost_seconds = round(resize.resumed_at_seconds - resize.detected_at_seconds, 1)
                resize.first_loss_after = record["learning/loss"]
                pending["resize"] = None
            if on_record is not None:
                on_record(record)

    while True:
        running = current["slices"]
        target_plan, target_stage = on_slices(plan, stage, running) if running != runnable[0] else (plan, stage)
        watch = _Watch(plan, stage, backend, running, runnable, wait_seconds, tell, records)
        interrupt = watch.interrupt
        finished = backend.follow(target_plan, target_stage, tagged, tell, interrupt=interrupt)
        current["restarts"] += finished.restarts
        current["causes"] += finished.restart_causes
        if finished.phase != "Interrupted":
            return Finished(phase=finished.phase, restarts=current["restarts"], leader_logs=finished.leader_logs,
                            restart_causes=current["causes"])  # fmt: skip
        decision = watch.decision
        last = next((r for r in reversed(records) if "step" in r), None)
        resize = elastic.Resize(
            from_slices=running,
            to_slices=decision.slices,
            cause=decision.cause,
            detected_at_seconds=round(watch.detected - started, 1),
            last_step_before=int(last["step"]) if last else None,
            last_loss_before=last["learning/loss"] if last else None,
        )
        resize.checkpoints_discarded = elastic.discard_unlogged_checkpoints(
            stage.checkpoint_dir, resize.last_step_before, watch.checkpoint_at_decision
        )
        resizes.append(resize)
        pending["resize"] = resize
        tell(f"resize {running} -> {decision.slices} slice(s): {decision.cause}")
        if resize.checkpoints_discarded:
            tell(
                f"checkpoint(s) {resize.checkpoints_discarded} committed while the workload stopped, their step "
                f"line never logged: deleted, training resumes from an earlier one"
            )
        new_plan, new_stage = (
            on_slices(plan, stage, decision.slices)
            if decision.slices != runnable[0]
            else (
                plan,
                stage,
            )
        )
        backend.relaunch(new_plan, new_stage, tell)
        current["slices"] = decision.slices


def result_pages(plan: Plan, stage_name: str, report: TrainReport) -> dict[str, str]:
    """The stage's pages for the pipelines UI: ``{"html": loss and step-time plots, "markdown": run summary}``.

    Built from the train report and the per-step metrics records it names
    (:mod:`multislice.delivery.artifacts`), and written beside the report, to
    ``<run_dir>/reports/<stage>/train.html`` and ``train.md``.
    """
    stage = plan.stage(stage_name)
    text = artifacts.train_markdown(stage.name, report)
    if report.skipped:
        page = artifacts.html_page(f"train {stage.name}", f"<p>{text.splitlines()[-1]}</p>")
    else:
        records = metrics.parse_records(storage.read_text(report.metrics_file) or "")
        page = artifacts.train_html(stage.name, report, records)
    artifacts.write_text(report_path(plan, "train.html", stage), page)
    artifacts.write_text(report_path(plan, "train.md", stage), text)
    return {"html": page, "markdown": text}
