"""The checkpoint verifier as a process of this machine's trainer environment.

Runs ``python -m multislice.trainer.verify`` (:func:`multislice.trainer.verify.command`)
and reads its JSON report from the process's output, as the GKE backend reads
it from the verifier Job's log.
"""

from __future__ import annotations

from multislice.backends.local.environment import trainer_env
from multislice.backends.local.tools import report_of, run_tool
from multislice.errors import RunFailed
from multislice.plan import StagePlan
from multislice.reports import VerificationReport
from multislice.trainer import verify


class VerifierFailed(RunFailed):
    """The verifier left no report (it could not start); the message has its exit status and output."""


def run(stage: StagePlan, checkpoint_dir: str, timeout: float) -> tuple[int, VerificationReport]:
    """Verify ``checkpoint_dir`` against the stage's model and final step.

    Returns:
        ``(exit status, report)``: 0 PASS, 1 FAIL, 2 the verifier could not run (the report says why).

    Raises:
        VerifierFailed: no report in its output.
        VerifierTimeout: it ran past ``timeout`` seconds (it was stopped).
        multislice.backends.local.environment.TrainerEnvMissing: no trainer environment.
    """
    argv = verify.command(
        checkpoint_dir, stage.final_step, list(stage.maxtext_args), str(trainer_env() / "bin" / "python")
    )
    done = run_tool(argv, timeout, "verify_checkpoint:verifying", f"the checkpoint verifier of {checkpoint_dir}")
    found = report_of(done, VerifierFailed, "checkpoint verifier")
    return done.returncode, VerificationReport.model_validate(found)
