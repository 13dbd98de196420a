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

from multislice import cancel, elastic, goodput, metrics, storage
from multislice.backends import Backend
from multislice.backends.base import Finished, TrainingFailed
from multislice.delivery import artifacts
from multislice.elastic import controller
from multislice.plan import Plan, StagePlan
from multislice.reports import AdmitReport, TrainReport, report_path
from multislice.steps import backend_of, cancellable, stage_labels, teller, write_report

__all__ = ["ECHO", "TrainingFailed", "note_restore", "result_pages", "run"]

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
    stage: StagePlan,
    admitted: AdmitReport | dict[str, Any],
    *,
    backend: Backend | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> TrainReport:
    """Follow the training of ``stage`` (one of ``plan.stages``) and summarise it; returns the train report.

    ``admitted`` is the admit step's report (a dict when it comes from another
    component); a stage admit skipped is passed through. ``on_record`` is called
    with each step's metrics record as it is logged (tests, fault injection).

    The workload is followed by the resize controller (:func:`multislice.elastic.controller.follow`): an elastic
    stage (``elastic`` in the spec) on a backend that resizes shrinks when it loses slices and grows back when
    capacity returns; any other is followed once.

    Raises:
        multislice.backends.base.TrainingFailed: the workload failed, the run was cancelled, or it still ran after
            ``timings.train_timeout``.
        multislice.backends.base.WorkloadDeleted: the workload was deleted during training.
    """
    admitted = AdmitReport.model_validate(admitted)
    with cancellable("train", stage, stage_labels(plan, stage, admitted.pipeline_run_id), plan) as removal:
        if admitted.skipped:
            return write_report(plan, TrainReport(jobset=stage.workload, skipped=True), stage)
        removal.backend = backend = backend_of(plan, backend, "train", stage)
        tell = teller("train", stage)
        records: list[dict[str, Any]] = []
        compiles: list[dict[str, Any]] = []  # the leader's XLA compiles, each attempt's in turn
        restores: list[dict[str, Any]] = []  # the checkpoint each attempt started from
        attempt = [-1]
        timeline = goodput.Timeline()  # the attempts' start-up, compiles, restores, saves and steps, timed
        started = time.monotonic()

        def on_line(line: str) -> None:
            timeline.add(time.monotonic() - started, line)
            if WORKER_START.search(line):
                attempt[0] += 1
            if compiled := metrics.parse_compile_line(line):
                compiles.append({"attempt": max(attempt[0], 0), **compiled})
            if (restored := metrics.parse_restore_line(line)) is not None:
                said = note_restore(restores, max(attempt[0], 0), restored)
                if said:
                    tell(said)
            record = metrics.parse_step_line(line) or metrics.parse_eval_line(line)
            if record:
                records.append(record)
                cancel.point("train:following")
            if ECHO.search(line):
                tell(line.split("] ", 1)[-1].strip())

        backend.prepare_verifier(plan, stage, admitted.pipeline_run_id, tell)  # its start beside the training
        with (
            backend.deleting_on_cancel(stage.workload, tell, removal.labels),
            backend.holding(stage.workload, "train", tell),
        ):
            finished, resizes = controller.follow(plan, stage, backend, records, on_line, tell, on_record)
        if finished.phase != "Completed":
            raise TrainingFailed(
                backend.failure_report(stage.workload),
                "fix the cause in the log lines above, then rerun with the same run_name: training resumes from the "
                "stage's last committed checkpoint",
            )
        if not records:
            raise TrainingFailed(
                f"JobSet {stage.workload} completed, but its leader logged no MaxText step line",
                f"read the leader's log ({', '.join(finished.leader_logs) or 'none found'})",
            )
        cancel.point("train:report")
        storage.write_text(stage.metrics_file, "".join(json.dumps(r) + "\n" for r in records))
        wall = time.monotonic() - started
        report, line = _report(stage, records, finished, resizes, wall, compiles, timeline.measure(wall))
        reread = data_reread(stage, restores)
        report = report.model_copy(update={"restores": restores, "data_reread": reread})
        tiers = [
            f"attempt {r['attempt']} from the {r['tier']} tier at step {r['step']}" for r in restores if "tier" in r
        ]
        line += "; restored " + ", ".join(tiers) if tiers else ""
        if reread:
            line += "; the hf stream started again from its start after each restart: " + ", ".join(
                f"attempt {r['attempt']} (from step {r['restored_step']}) re-read {r['steps']} steps' data"
                for r in reread
            )
        tell(line)
        return write_report(plan, report, stage)


def data_reread(stage: StagePlan, restores: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a stage on streamed data (``hf``), how many steps of each restarted attempt trained again on data the
    stage had already trained on: ``[{"attempt", "restored_step", "steps"}]``; ``[]`` for other data.

    MaxText 0.2.5 saves a data iterator with the checkpoint only for ``dataset_type: grain``
    (``common/checkpointing.py``, ``save_checkpoint`` and ``load_state_if_possible``); its ``hf`` pipeline streams
    the dataset (``datasets.load_dataset(..., streaming=True)``, ``input_pipeline/hf_data_processing.py``), so an
    attempt that restores step ``s`` trains step ``s + 1`` on the stream's first batch again: the batches of steps
    ``0..s`` come again, for ``min(s + 1, steps - s - 1)`` steps (to the stage's end). An attempt that restored no
    checkpoint starts the model again too: nothing is re-read. Grain data keeps its position (an elastic stage's
    through the elastic iterator, :func:`multislice.plan.elastic_iterator_args`).
    """
    if "dataset_type=hf" not in stage.maxtext_args:
        return []
    return [
        {"attempt": r["attempt"], "restored_step": r["step"], "steps": min(r["step"] + 1, stage.steps - r["step"] - 1)}
        for r in restores
        if r.get("attempt", 0) > 0 and r.get("step") is not None
    ]


def note_restore(restores: list[dict[str, Any]], attempt: int, restored: dict[str, Any]) -> str:
    """Add what a leader log line said about attempt ``attempt``'s starting checkpoint to ``restores`` (one record
    per attempt: MaxText's line gives the step, Orbax's emergency manager's line then the tier); returns the line to
    tell once the tier is known (``attempt 1 restored from the local tier at step 20 (slice 1)``), else ''.

    Args:
        restores: The records so far (:attr:`multislice.reports.TrainReport.restores`), changed in place.
        attempt: The attempt the line belongs to (0 first, 1 after the first restart...).
        restored: :func:`multislice.metrics.parse_restore_line`'s record of the line.
    """
    if restores and restores[-1]["attempt"] == attempt:
        record = restores[-1]
        record.update({key: value for key, value in restored.items() if value is not None or key not in record})
    else:
        record = {"attempt": attempt, **restored}
        restores.append(record)
    if "tier" not in restored:
        return ""
    held = f" (slice {record['slice']})" if "slice" in record else ""
    return f"attempt {attempt} restored from the {record['tier']} tier at step {record['step']}{held}"


def _report(
    stage: StagePlan,
    records: list[dict[str, Any]],
    finished: Finished,
    resizes: list[elastic.Resize],
    wall: float,
    compiles: list[dict[str, Any]],
    good: goodput.Goodput,
) -> tuple[TrainReport, str]:
    """The train report of a completed stage from its metrics records (with goodput and its badput by cause; an
    elastic stage's also with resizes and slice timeline), and its one-line summary. ``wall``: seconds the train step
    followed the stage; ``compiles``: the leader's XLA compiles, each tagged with its attempt
    (:func:`multislice.metrics.parse_compile_line`); ``good``: the stage's goodput
    (:func:`multislice.goodput.measure`)."""
    summary = metrics.summarize(records)
    measured = summary.as_dict() | metrics.summarize_eval(records)
    fields: dict[str, Any] = good.report_fields()
    if stage.elastic:
        steps = [r for r in records if "step" in r]  # eval records (eval_after_step) are not steps
        fields |= {
            "resizes": resizes,
            "slice_timeline": elastic.slice_timeline(steps),
            "global_batch_size": stage.global_batch_size,
        }
    report = TrainReport(
        jobset=stage.workload,
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
    line = (
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
        + f"; goodput {good.goodput:.2f} of {good.job_seconds:.0f} s (badput: "
        + goodput.badput_words(good.badput_seconds)
        + ")"
    )
    return report, line


def result_pages(plan: Plan, stage: StagePlan, report: TrainReport) -> dict[str, str]:
    """The stage's pages for the pipelines UI: ``{"html": loss and step-time plots, "markdown": run summary}``.

    Built from the train report and the per-step metrics records it names
    (:mod:`multislice.delivery.artifacts`), and written beside the report, to
    ``<run_dir>/reports/<stage>/train.html`` and ``train.md``.
    """
    text = artifacts.train_markdown(stage.name, report)
    if report.skipped:
        page = artifacts.html_page(f"train {stage.name}", f"<p>{text.splitlines()[-1]}</p>")
    else:
        written = storage.read_text(report.metrics_file) if report.metrics_file else None
        records = metrics.parse_records(written or "")
        page = artifacts.train_html(stage.name, report, records)
    artifacts.write_text(report_path(plan, "train.html", stage), page)
    artifacts.write_text(report_path(plan, "train.md", stage), text)
    return {"html": page, "markdown": text}
