"""verify_checkpoint: check a stage's final checkpoint before the next stage may start.

Runs the checkpoint verifier (:mod:`multislice.trainer.verify`, trainer
environment) against the stage's checkpoint directory with the stage's
MaxText arguments, so the expected parameter tree comes from the model
config, and reads its JSON report. On the local backend the verifier is a
process in the trainer environment; on GKE it will be a Job in the trainer
image (not built yet). A FAIL fails the step, so a later stage never starts
from an unverified one.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from multislice.backends import backend_for
from multislice.backends.local import trainer_env
from multislice.plan import Plan
from multislice.steps import report_path, say, write_report

VERIFY_TIMEOUT_SECONDS = 1800


class VerificationFailed(RuntimeError):
    """The checkpoint failed a check (or the verifier could not run); the message lists which."""


def run(plan: Plan, stage_name: str) -> dict[str, Any]:
    """Verify the stage's final checkpoint; returns the verifier's report (verdict PASS).

    Raises:
        VerificationFailed: verdict FAIL or ERROR, with the failed checks.
    """
    stage = plan.stage(stage_name)
    backend_for(plan.spec.backend, plan.run_dir)
    env = trainer_env()
    report_file = report_path(plan, "verification", stage)
    report_file.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(env / "bin" / "python"), "-m", "multislice.trainer.verify",
        "--checkpoint-dir", stage.checkpoint_dir,
        "--expected-step", str(stage.final_step),
        "--report", str(report_file),
        "--", *stage.maxtext_args,
    ]  # fmt: skip
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    child_env.update(JAX_PLATFORMS="cpu", PATH=f"{env / 'bin'}:{os.environ.get('PATH', '')}")
    done = subprocess.run(command, capture_output=True, text=True, env=child_env, timeout=VERIFY_TIMEOUT_SECONDS)
    if not report_file.exists():
        raise VerificationFailed(f"the verifier wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}")
    report = json.loads(report_file.read_text(encoding="utf-8"))
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
            + f" (report {report_file})"
        )
    say(
        "verify_checkpoint",
        f"PASS: step {report['latest_step']}, {report['parameter_count']:,} parameters, "
        f"written with mesh {report.get('written_mesh')}",
        stage.name,
    )
    return write_report(plan, "verify_checkpoint", {**report, "report_file": str(report_file)}, stage)
