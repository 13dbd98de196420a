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
from typing import Any

from multislice import cancel, metrics, storage
from multislice.backends import Backend
from multislice.backends.base import TrainingFailed
from multislice.delivery import artifacts
from multislice.plan import Plan
from multislice.reports import AdmitReport, TrainReport, report_path
from multislice.steps import backend_of, cancellable, stage_labels, teller, write_report

__all__ = ["ECHO", "TrainingFailed", "result_pages", "run"]

#: Log lines worth echoing from the leader: MaxText's step lines, the worker's and the mesh.
ECHO = re.compile(
    r"completed step:|Completed eval after|multislice worker:|emulated multislice mesh|Num_devices: \d|"
    r"restoring from this run's directory step|No existing checkpoints found"
)


def run(
    plan: Plan, stage_name: str, admitted: AdmitReport | dict[str, Any], *, backend: Backend | None = None
) -> TrainReport:
    """Follow the stage's training and summarise it; returns the train report.

    ``admitted`` is the admit step's report (a dict when it comes from another
    component); a stage admit skipped is passed through.

    Raises:
        multislice.backends.base.TrainingFailed: the workload failed, the run was cancelled, or it still ran after
            ``timings.train_timeout``.
        multislice.backends.base.WorkloadDeleted: the workload was deleted during training.
    """
    stage = plan.stage(stage_name)
    with cancellable("train", stage, stage_labels(plan, stage), plan) as removal:
        admitted = AdmitReport.model_validate(admitted)
        if admitted.skipped:
            return write_report(plan, TrainReport(jobset=stage.jobset, skipped=True), stage)
        removal.backend = backend = backend_of(plan, backend, "train", stage)
        tell = teller("train", stage)
        records: list[dict[str, Any]] = []

        def on_line(line: str) -> None:
            record = metrics.parse_step_line(line) or metrics.parse_eval_line(line)
            if record:
                records.append(record)
                cancel.point("train:following")
            if ECHO.search(line):
                tell(line.split("] ", 1)[-1].strip())

        started = time.monotonic()
        with backend.deleting_on_cancel(stage.jobset, tell, removal.labels):
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
        report = TrainReport(
            jobset=stage.jobset,
            steps_trained=measured.pop("steps_recorded"),
            restarts=finished.restarts,
            wall_seconds=round(time.monotonic() - started, 1),
            **measured,
            metrics_file=stage.metrics_file,
            leader_logs=finished.leader_logs,
        )
        tell(
            f"completed {summary.steps_recorded} steps, loss {summary.first_loss:.3f} -> {summary.final_loss:.3f}, "
            f"{summary.tokens_per_second_per_device:.0f} tokens/s/device, restarts {finished.restarts}"
            + (
                f"; eval loss {report.first_eval_loss:.3f} -> {report.final_eval_loss:.3f} "
                f"(perplexity {report.final_eval_perplexity:.1f}, {report.evals} evals)"
                if report.evals
                else ""
            )
        )
        return write_report(plan, report, stage)


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
