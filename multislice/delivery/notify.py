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
failed."), the run directory tells it: the first step of the pipeline's
order whose report is missing in the run directory, local or ``gs://``
(:func:`failed_step_from_reports`).

A post that fails never fails the exit handler: the error is returned and
printed, and cleanup goes on.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any

from multislice import storage

#: Each stage's steps before provision, then after it, in pipeline order: (step, report file).
BEFORE_PROVISION = (("plan", "plan.json"), ("preflight", "preflight.json"))
AFTER_PROVISION = (
    ("admit", "admit.json"), ("launch", "launch.json"), ("train", "train.json"),
    ("verify_checkpoint", "verification.json"),
)  # fmt: skip
#: Reports written even when their step fails (then before it raises): file -> the verdicts of a step that passed.
PASSING_VERDICTS = {"preflight.json": ("fits", "skipped"), "verification.json": ("PASS",)}
POST_TIMEOUT_SECONDS = 10.0
_FAILED_TASKS = re.compile(r"failed tasks are: \[([^\]]*)\]")


def _done(path: Any) -> bool:
    """The step behind a report file finished: the report exists and, where it has a verdict, a passing one."""
    if not path.exists():
        return False
    passing = PASSING_VERDICTS.get(path.name)
    return passing is None or json.loads(path.read_text()).get("verdict") in passing


def failed_step_from_reports(run_dir: str) -> str | None:
    """The first step that did not finish, from a run directory's reports; None if every step did.

    Returns ``<step> <stage>`` or ``provision``. Reads ``<run_dir>/reports``
    (local or ``gs://``); stages are ordered as in their plan report
    (``reports/<stage>/plan.json``). A preflight report that is not ``fits``
    (or ``skipped``) and a verification that is not ``PASS`` count as failed
    steps: both are written before their step raises.
    """
    reports = storage.path(run_dir) / "reports"
    stages: list[str] = []
    for plan_file in reports.glob("*/plan.json"):
        try:
            stages = [s["name"] for s in json.loads(plan_file.read_text())["plan"]["stages"]]
        except (ValueError, KeyError, TypeError):
            continue
        break
    if not stages:
        return "plan"
    for stage in stages:
        for step, file_name in BEFORE_PROVISION:
            if not _done(reports / stage / file_name):
                return f"{step} {stage}"
    if not (reports / "provision.json").exists():
        return "provision"
    for stage in stages:
        for step, file_name in AFTER_PROVISION:
            if not _done(reports / stage / file_name):
                return f"{step} {stage}"
    return None


def failed_step(error_message: str | None, run_dir: str | None) -> str | None:
    """The failed step: from the orchestrator's error message if it names the tasks, else from the run's reports."""
    match = _FAILED_TASKS.search(error_message or "")
    if match:
        return match.group(1).strip()
    if run_dir is None:
        return None
    try:
        return failed_step_from_reports(str(run_dir))
    except Exception:  # noqa: BLE001 - best effort: an unreadable run directory must not fail the exit handler
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
