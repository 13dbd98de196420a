"""verify_checkpoint: check a stage's final checkpoint before the next stage may start.

Runs the checkpoint verifier (:mod:`multislice.trainer.verify`, trainer
environment) against the stage's checkpoint directory with the stage's
MaxText arguments, so the expected parameter tree comes from the model
config, and reads its JSON report. On the local backend the verifier is a
process in the trainer environment; on GKE it is a Job in the trainer image
(:mod:`multislice.backends.gke.verifier`) whose JSON report is read from its
pod's log. A FAIL fails the step, so a later stage never starts
from an unverified one.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from multislice import names
from multislice.backends.local import trainer_env, trainer_process_env
from multislice.plan import Plan, StagePlan
from multislice.steps import gke_api, is_local_path, report_path, say, write_report

VERIFY_TIMEOUT_SECONDS = 1800


class VerificationFailed(RuntimeError):
    """The checkpoint failed a check (or the verifier could not run); the message lists which."""


def run_verifier(stage: StagePlan, checkpoint_dir: str, report_file: Path) -> tuple[int, dict[str, Any]]:
    """Run the verifier in the trainer environment on a stage's checkpoints.

    Returns:
        ``(exit status, report)``; the report is also written to ``report_file``.

    Raises:
        VerificationFailed: the verifier wrote no report (it could not start).
    """
    env = trainer_env()
    report_file.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(env / "bin" / "python"), "-m", "multislice.trainer.verify",
        "--checkpoint-dir", checkpoint_dir,
        "--expected-step", str(stage.final_step),
        "--report", str(report_file),
        "--", *stage.maxtext_args,
    ]  # fmt: skip
    report_file.unlink(missing_ok=True)
    done = subprocess.run(
        command, capture_output=True, text=True, env=trainer_process_env(env), timeout=VERIFY_TIMEOUT_SECONDS
    )
    if not report_file.exists():
        raise VerificationFailed(f"the verifier wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.returncode, json.loads(report_file.read_text(encoding="utf-8"))


def _run_gke_verifier(plan: Plan, stage: StagePlan, kube: Any) -> dict[str, Any]:
    from multislice.backends.gke import verifier

    js = kube.get_jobset(stage.jobset) or {}
    run_id = js.get("metadata", {}).get("labels", {}).get(names.LABEL_PIPELINE_RUN_ID, "none")
    return verifier.run(
        kube, plan, stage, run_id, timeout=kube.timings.verify_timeout,
        on_progress=lambda message: say("verify_checkpoint", message, stage.name),
    )  # fmt: skip


def run(plan: Plan, stage_name: str, *, kube: Any = None, timings: Any = None) -> dict[str, Any]:
    """Verify the stage's final checkpoint; returns the verifier's report (verdict PASS).

    On GKE the verifier runs as a Job labelled with the pipeline run id of the
    stage's JobSet; ``kube`` and ``timings`` replace the API client and waits.

    Raises:
        VerificationFailed: verdict FAIL or ERROR, with the failed checks.
        multislice.backends.gke.verifier.VerifierJobFailed: (GKE) the Job left no report.
    """
    stage = plan.stage(stage_name)
    report_file = report_path(plan, "verification", stage)
    if plan.spec.backend == "gke":
        report = _run_gke_verifier(plan, stage, gke_api(plan, "verify_checkpoint", stage, kube, timings))
    else:
        _, report = run_verifier(stage, stage.checkpoint_dir, report_file)
    result_page(plan, stage_name, report)  # written before a FAIL raises, so a failed check has its page too
    for check in report.get("checks", []):
        say(
            "verify_checkpoint",
            f"{'PASS' if check['passed'] else 'FAIL'} {check['name']}: {check['detail']}",
            stage.name,
        )
    if report.get("verdict") != "PASS":
        failed = [f"{c['name']}: {c['detail']}" for c in report.get("checks", []) if not c["passed"]]
        raise VerificationFailed(
            f"checkpoint {stage.checkpoint_dir} verdict {report.get('verdict')}: "
            + ("; ".join(failed) or report.get("error", "no detail"))
            + f" (report {report.get('job') or report_file})"
        )
    say(
        "verify_checkpoint",
        f"PASS: step {report['latest_step']}, {report['parameter_count']:,} parameters, "
        f"written with mesh {report.get('written_mesh')}",
        stage.name,
    )
    where = {"job": report["job"]} if "job" in report else {"report_file": str(report_file)}
    return write_report(plan, "verify_checkpoint", {**report, **where}, stage)


def result_page(plan: Plan, stage_name: str, report: dict[str, Any]) -> str:
    """The verifier's report as Markdown for the pipelines UI.

    Built by :func:`multislice.delivery.artifacts.verification_markdown`.

    For a local run directory it is also written to ``<run_dir>/reports/<stage>/verification.md``.
    """
    from multislice.delivery import artifacts

    stage = plan.stage(stage_name)
    text = artifacts.verification_markdown(stage.name, report)
    if is_local_path(plan.run_dir):
        artifacts.write_text(report_path(plan, "verification", stage).with_suffix(".md"), text)
    return text
