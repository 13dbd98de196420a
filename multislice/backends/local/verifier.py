"""The checkpoint verifier as a process of this machine's trainer environment.

Runs ``python -m multislice.trainer.verify`` (:func:`multislice.trainer.verify.command`)
and reads its JSON report from the process's output, as the GKE backend reads
it from the verifier Job's log.
"""

from __future__ import annotations

from multislice.backends.local.environment import trainer_env
from multislice.backends.local.tools import Runner, report_of, run_tool
from multislice.errors import RunFailed
from multislice.plan import StagePlan
from multislice.reports import VerificationReport
from multislice.trainer import verify


class VerifierFailed(RunFailed):
    """The verifier left no report (it could not start); the message has its exit status and output."""


def command(stage: StagePlan, checkpoint_dir: str | None = None) -> list[str]:
    """The verifier's command for the stage's final checkpoint (``checkpoint_dir``: default the stage's)."""
    return verify.command(
        checkpoint_dir or stage.checkpoint_dir, stage.final_step, list(stage.maxtext_args),
        str(trainer_env() / "bin" / "python"),
    )  # fmt: skip


def run(
    stage: StagePlan, checkpoint_dir: str, timeout: float, runner: Runner = run_tool
) -> tuple[int, VerificationReport]:
    """Verify ``checkpoint_dir`` against the stage's model and final step (``runner`` runs the command: a new
    process by default, :func:`.tools.run_tool`).

    Returns:
        ``(exit status, report)``: 0 PASS, 1 FAIL, 2 the verifier could not run (the report says why).

    Raises:
        VerifierFailed: no report in its output.
        VerifierTimeout: it ran past ``timeout`` seconds (it was stopped).
        multislice.backends.local.environment.TrainerEnvMissing: no trainer environment.
    """
    argv = command(stage, checkpoint_dir)
    done = runner(argv, timeout, "verify_checkpoint:verifying", f"the checkpoint verifier of {checkpoint_dir}")
    found = report_of(done, VerifierFailed, "checkpoint verifier")
    return done.returncode, VerificationReport.model_validate(found)
