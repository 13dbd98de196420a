"""Failure notification: the exit handler posts the run's final status to a webhook (Slack-compatible JSON).

The message is a Slack incoming-webhook payload (Slack docs, "Sending
messages using incoming webhooks": a JSON object with ``text``, optionally
``blocks``); Google Chat and Microsoft Teams/Discord-style receivers that
read ``text`` accept it too. Extra keys (``status``, ``failed_step``,
``error``, ``run_name``, ``pipeline_job``) carry the same facts for receivers
that parse them.

The final state (:func:`normalize_state`): each orchestrator spells it its
own way in ``PipelineTaskFinalStatus.state``. Vertex AI Pipelines uses its
``PipelineTaskDetail.State`` names, ``SUCCEEDED`` / ``FAILED`` /
``CANCELLED``, with ``error.message`` "The DAG failed because some tasks
failed. The failed tasks are: [train-2]." (the IR task names). The KFP
backend's v2 driver (2.14 to 2.17, ``backend/src/v2/driver``) passes the
exit-handler DAG's MLMD execution state, ``COMPLETE`` / ``FAILED`` /
``CANCELED``, with an empty error message; kfp.local says ``SUCCEEDED`` /
``FAILED`` and "Task exit-handler-1 failed.". The message always says
``SUCCEEDED``, ``FAILED`` or ``CANCELLED`` and keeps the raw state too.

The failed step: from the orchestrator's error message when it names the
tasks (Vertex), mapped from the IR task name (``train-2``) to the step and
stage (``train <second stage>``); where it does not (KFP's empty error,
kfp.local's "Task exit-handler-1 failed."), the run directory tells it: the
first step of the pipeline's order whose report is missing in the run
directory, local or ``gs://`` (:func:`failed_step_from_reports`).

The webhook URL is a secret (whoever has it can post to the channel), so it
is never a pipeline parameter and never in the compiled YAML
(:func:`webhook_url`): on KFP the compiled pipeline mounts key ``url`` of the
Kubernetes Secret ``multislice-notify-webhook`` as ``$MULTISLICE_NOTIFY_WEBHOOK_URL``
into the exit handler (kfp-kubernetes ``use_secret_as_env``); on Vertex AI,
which runs no Kubernetes platform config, the ``notify_webhook_secret``
parameter names a Secret Manager secret version, read at run time
(Secret Manager REST API ``projects.secrets.versions.access``:
``GET https://secretmanager.googleapis.com/v1/{name}:access``, the payload's
``data`` base64-encoded) with the run's service account (it needs
``roles/secretmanager.secretAccessor`` on the secret); locally the variable
comes from the user's environment.

A post that fails never fails the exit handler: the error is returned and
printed, and cleanup goes on.

Once per run: on GKE the exit handler and ``multislice reap`` (which ends a
run whose exit handler never came, e.g. KFP Terminate) both claim the message
before posting (:meth:`multislice.backends.base.Backend.claim_notification`,
a tombstone Lease created once), so a terminated run gets one ``CANCELLED``
message whichever of them runs, or both.
"""

from __future__ import annotations

import base64
import json
import os
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
#: Environment variable the exit handler reads the webhook URL from (KFP: set from the Kubernetes Secret).
WEBHOOK_ENV = "MULTISLICE_NOTIFY_WEBHOOK_URL"
#: Secret Manager's REST endpoint (tests point it at a loopback fake).
SECRET_MANAGER_ENDPOINT = "https://secretmanager.googleapis.com"
_URL = re.compile(r"https?://[^\s/]+(/\S*)?")


def webhook_url(secret: str = "", credentials: object = None) -> tuple[str | None, str | None]:
    """The webhook URL for this run, and a problem if it could not be had: ``(url or None, problem or None)``.

    ``$MULTISLICE_NOTIFY_WEBHOOK_URL`` when set (KFP's Kubernetes Secret, or
    the local environment); else, with ``secret`` (a Secret Manager secret
    version name), that version's payload, read with ``credentials`` (default:
    the environment's, i.e. the run's service account on Vertex AI). Never
    raises: a notification must not fail the exit handler. Neither the URL nor
    the payload is ever printed; a problem names the secret, not its value.
    """
    url = os.environ.get(WEBHOOK_ENV, "").strip()
    if not url and secret:
        try:
            import google.auth
            from google.auth.transport.requests import AuthorizedSession

            if credentials is None:
                credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
            answer = AuthorizedSession(credentials).get(
                f"{SECRET_MANAGER_ENDPOINT}/v1/{secret}:access", timeout=POST_TIMEOUT_SECONDS
            )
            if answer.status_code != 200:
                return None, f"Secret Manager answered HTTP {answer.status_code} for {secret}"
            url = base64.b64decode(answer.json()["payload"]["data"]).decode("utf-8").strip()
        except Exception as error:  # noqa: BLE001 - best effort, as the post is
            return None, f"could not read {secret} from Secret Manager: {type(error).__name__}"
    if not url:
        return None, None
    if not _URL.fullmatch(url):
        return None, "the webhook secret does not hold an http(s) URL"
    return url, None


_FAILED_TASKS = re.compile(r"failed tasks are: \[([^\]]*)\]")
#: Final states by orchestrator spelling -> the one the message uses.
STATES = {
    "SUCCEEDED": "SUCCEEDED",  # Vertex AI, kfp.local
    "COMPLETE": "SUCCEEDED",  # KFP backend driver (MLMD Execution.State COMPLETE)
    "CACHED": "SUCCEEDED",  # KFP: MLMD CACHED (caching is off in this pipeline; kept for completeness)
    "FAILED": "FAILED",  # all
    "CANCELLED": "CANCELLED",  # Vertex AI
    "CANCELED": "CANCELLED",  # KFP backend driver (MLMD Execution.State CANCELED)
}
#: IR task names (``<component name>[-<n>]``, n counting the component's tasks from 2) -> the step's name.
_TASK_NAME = re.compile(r"^(?P<step>plan|preflight|provision|admit|launch|train|verify-checkpoint)(?:-(?P<n>[0-9]+))?$")


def normalize_state(state: str | None) -> str:
    """``SUCCEEDED``, ``FAILED`` or ``CANCELLED`` for a backend's ``PipelineTaskFinalStatus.state``; else upper-cased.

    Vertex AI's ``SUCCEEDED``/``FAILED``/``CANCELLED`` and the KFP driver's
    ``COMPLETE``/``FAILED``/``CANCELED`` (see the module docstring); '' or
    None is ``UNKNOWN``.
    """
    raw = (state or "").strip().upper()
    return STATES.get(raw, raw or "UNKNOWN")


def _stages(run_dir: str | None) -> list[str]:
    """The run's stage names in order, from any ``reports/<stage>/plan.json``; [] when none can be read."""
    if run_dir is None:
        return []
    try:
        for plan_file in (storage.path(str(run_dir)) / "reports").glob("*/plan.json"):
            try:
                return [s["name"] for s in json.loads(plan_file.read_text())["plan"]["stages"]]
            except (ValueError, KeyError, TypeError):
                continue
    except Exception:  # noqa: BLE001 - best effort
        return []
    return []


def step_of_task(task: str, stages: list[str]) -> str:
    """``<step> <stage>`` for an IR task name (``train-2`` -> ``train <stages[1]>``); the name itself otherwise.

    The pipeline adds one task per component per stage in stage order, and the
    KFP compiler names a component's n-th task ``<name>-<n>`` (the first has no
    suffix): so ``n`` is the stage's number. ``provision`` has one task.
    """
    match = _TASK_NAME.fullmatch(task.strip())
    if not match:
        return task.strip()
    step = match.group("step").replace("-", "_")
    if step == "provision":
        return step
    index = int(match.group("n") or 1) - 1
    return f"{step} {stages[index]}" if 0 <= index < len(stages) else task.strip()


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
        stages = _stages(run_dir)
        return ", ".join(step_of_task(task, stages) for task in match.group(1).split(",") if task.strip())
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
        state: ``PipelineTaskFinalStatus.state`` as the backend spells it (:func:`normalize_state`).
        error_message: The orchestrator's error message, when it failed.
        step: The failed step (:func:`failed_step`).
        pipeline_job: ``PipelineTaskFinalStatus.pipeline_job_resource_name``.

    Returns:
        ``{"text": ..., "status", "backend_state", "run_name", "failed_step", "error", "pipeline_job"}``;
        ``status`` is ``SUCCEEDED``, ``FAILED`` or ``CANCELLED``, ``backend_state`` the raw state.
    """
    raw_state, state = state, normalize_state(state)
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
        "backend_state": raw_state,
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
