"""The checkpoint verifier as a Kubernetes Job in the trainer image, and its JSON report read from the pod log.

The Job runs ``python -m multislice.trainer.verify`` (the same verifier the
local backend runs) against the stage's checkpoint directory in Cloud
Storage; the verifier prints its JSON report as the last thing on stdout
(``multislice/trainer/verify.py``, ``main``), which is read back from the
pod's log. The Job runs as the trainer's ServiceAccount
(``service_accounts.trainer``, :mod:`multislice.render.rbac`), whose Workload
Identity lets it read the bucket. Job status read (batch/v1 ``JobStatus``):
conditions ``Complete`` and ``Failed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from multislice.backends.gke import jobs
from multislice.backends.gke import pods as pod_state
from multislice.backends.gke.client import Kube
from multislice.errors import RunFailed
from multislice.plan import Plan, StagePlan
from multislice.render.trainer_job import render_trainer_job
from multislice.trainer import verify


class VerifierJobFailed(RunFailed):
    """The verifier Job did not produce a report; the message has its state, events and log tail."""


def job_name(stage: StagePlan) -> str:
    """``<jobset>-verify`` (the JobSet name leaves room for it: pod names are longer)."""
    return f"{stage.workload}-verify"


def render_job(plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
    """The verifier Job (batch/v1): one pod, no retries, the trainer image, CPU only."""
    command = verify.command(stage.checkpoint_dir, stage.final_step, list(stage.maxtext_args))
    return render_trainer_job(plan, job_name(stage), command, pipeline_run_id, stage=stage)


def run(
    kube: Kube,
    plan: Plan,
    stage: StagePlan,
    pipeline_run_id: str,
    *,
    timeout: float,
    on_progress: Callable[[str], None],
) -> dict[str, Any]:
    """Create (or adopt) the verifier Job, wait for it to finish and return its report.

    Raises:
        VerifierJobFailed: no report in the log (the message quotes the pod's state, events and log tail).
        TimeoutError: not finished within ``timeout`` seconds.
        multislice.backends.gke.jobset.JobSetConflict: a Job of that name with another spec exists.
    """
    return run_report_job(
        kube, render_job(plan, stage, pipeline_run_id), timeout=timeout, on_progress=on_progress,
        what="verifier Job", failure=VerifierJobFailed,
        fix="read the events above; check the trainer image and that its ServiceAccount may read the checkpoints",
    )  # fmt: skip


def run_report_job(
    kube: Kube,
    body: dict[str, Any],
    *,
    timeout: float,
    on_progress: Callable[[str], None],
    what: str,
    failure: type[RunFailed],
    fix: str,
    stored: Callable[[], dict[str, Any] | None] | None = None,
    parse: Callable[[str], dict[str, Any] | None] = verify.parse_report,
    early: bool = False,
) -> dict[str, Any]:
    """Run a trainer-image Job whose pod prints a JSON report last (:func:`multislice.trainer.verify.parse_report`,
    as the verifier and the exporter do) and return that report, with ``job`` set to the Job's name.

    ``parse`` finds the report in the log (default the last JSON document); with ``early``, the wait ends as soon
    as ``parse`` finds it in the running pod's log (:func:`.jobs.run_job`'s ``until``), the Job going on. When the
    log has no report (rotated away) and the Job completed, ``stored`` (if given) reads the copy the pod wrote.

    Raises:
        failure: no report (the message quotes the pod's events and log tail; ``fix`` is its fix).
        TimeoutError: not finished within ``timeout`` seconds (:func:`.jobs.run_job`).
    """
    state, log, pod = jobs.run_job(
        kube, body, timeout=timeout, on_progress=on_progress, what=what, until=parse if early else None
    )
    name = body["metadata"]["name"]
    report = parse(log)
    if report is None and state == "Complete" and stored is not None:
        report = stored()
    if report is None:
        detail = pod_state.events(kube, pod) if pod is not None else "no pod found"
        raise failure(
            f"{what} {name} {state} without a JSON report; events:\n{detail}\nlast log lines:\n"
            + "\n".join(log.splitlines()[-20:]),
            fix,
        )
    report["job"] = name
    return report
