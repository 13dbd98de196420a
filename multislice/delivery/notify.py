"""Failure notification: the exit handler posts the run's final status to a webhook (Slack-compatible JSON).

The message is a Slack incoming-webhook payload (Slack docs, "Sending
messages using incoming webhooks": a JSON object with ``text``, optionally
``blocks``); Google Chat and Microsoft Teams/Discord-style receivers that
read ``text`` accept it too. Extra keys (``status``, ``failed_step``,
``error``, ``run_name``, ``pipeline_job``) carry the same facts for receivers
that parse them.

The failed step: the orchestrator's own error message names it on KFP and
Vertex AI ("The DAG failed because some tasks failed. The failed tasks are:
[train]."); where it does not (kfp.local says only "Task exit-handler-1
failed."), a local run directory tells it: the first step of the pipeline's
order whose report is missing (:func:`failed_step_from_reports`).

A post that fails never fails the exit handler: the error is returned and
printed, and cleanup goes on.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: Step reports in pipeline order, as ``multislice.steps`` writes them per stage.
STAGE_STEPS = ("plan", "admit", "launch", "train", "verify_checkpoint")
POST_TIMEOUT_SECONDS = 10.0
_FAILED_TASKS = re.compile(r"failed tasks are: \[([^\]]*)\]")


def failed_step_from_reports(run_dir: str | Path) -> str | None:
    """The first step without a report in a local run directory (``<stage> <step>`` or ``provision``); None if none.

    Stages are ordered by their plan's stage index (``reports/<stage>/plan.json``).
    """
    reports = Path(run_dir) / "reports"
    if not reports.is_dir():
        return "plan"
    stages = []
    for plan_file in reports.glob("*/plan.json"):
        try:
            plan = json.loads(plan_file.read_text(encoding="utf-8"))["plan"]
            order = [s["name"] for s in plan["stages"]]
        except (ValueError, KeyError, TypeError):
            continue
        stages = order
        break
    if not stages:
        return "plan"
    for index, stage in enumerate(stages):
        for step in STAGE_STEPS:
            if step == "admit" and index == 0 and not (reports / "provision.json").is_file():
                return "provision"
            if not (reports / stage / f"{step}.json").is_file():
                return f"{step} {stage}"
    return None


def failed_step(error_message: str | None, run_dir: str | Path | None) -> str | None:
    """The failed step: from the orchestrator's error message if it names the tasks, else from local reports."""
    match = _FAILED_TASKS.search(error_message or "")
    if match:
        return match.group(1).strip()
    if run_dir is not None and "://" not in str(run_dir):
        return failed_step_from_reports(run_dir)
    return None


def status_payload(
    run_name: str,
    state: str,
    error_message: str | None = None,
    step: str | None = None,
    pipeline_job: str = "",
) -> dict[str, Any]:
    """The Slack-compatible message of a run's final status.

    Args:
        run_name: The run's name (the run directory's name).
        state: ``SUCCEEDED``, ``FAILED`` or ``CANCELLED`` (``PipelineTaskFinalStatus.state``).
        error_message: The orchestrator's error message, when it failed.
        step: The failed step (:func:`failed_step`).
        pipeline_job: ``PipelineTaskFinalStatus.pipeline_job_resource_name``.

    Returns:
        ``{"text": ..., "status", "run_name", "failed_step", "error", "pipeline_job"}``.
    """
    icon = {"SUCCEEDED": ":white_check_mark:", "FAILED": ":x:", "CANCELLED": ":warning:"}.get(state, ":grey_question:")
    text = f"{icon} multislice run `{run_name}` {state}"
    if step:
        text += f" at step `{step}`"
    if error_message:
        text += f"\n> {error_message.strip()[:1500]}"
    if pipeline_job:
        text += f"\npipeline job: {pipeline_job}"
    return {
        "text": text,
        "status": state,
        "run_name": run_name,
        "failed_step": step,
        "error": error_message or None,
        "pipeline_job": pipeline_job,
    }


def post(url: str, payload: dict[str, Any], timeout: float = POST_TIMEOUT_SECONDS) -> str | None:
    """POST ``payload`` as JSON to ``url``; returns None on a 2xx answer, else the error as text (never raises)."""
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode("utf-8"),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - http(s) checked by the spec
            response.read()
        return None
    except urllib.error.HTTPError as error:
        return f"webhook answered HTTP {error.code}: {error.read()[:300].decode('utf-8', 'replace')}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        return f"webhook post failed: {error}"
