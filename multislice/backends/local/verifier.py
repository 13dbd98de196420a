"""The checkpoint verifier as a process of this machine's trainer environment.

Runs ``python -m multislice.trainer.verify`` (:func:`multislice.trainer.verify.command`)
and reads its JSON report from the process's output, as the GKE backend reads
it from the verifier Job's log.
"""

from __future__ import annotations

import subprocess

from multislice import cancel
from multislice.backends.base import VerifierTimeout
from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.cancel import die_with_parent
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
    env = trainer_env()
    argv = verify.command(checkpoint_dir, stage.final_step, list(stage.maxtext_args), str(env / "bin" / "python"))
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=trainer_process_env(env),
        preexec_fn=die_with_parent(),  # a SIGKILLed step's verifier goes with it
    )  # fmt: skip
    try:
        cancel.point("verify_checkpoint:verifying")
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException as error:  # a timeout, or a cancel (multislice.cancel.Cancelled): stop it first
        process.kill()
        process.communicate()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        raise VerifierTimeout(
            f"the checkpoint verifier of {checkpoint_dir} ran past {timeout:.0f} s and was stopped",
            "raise timeouts.verify if the checkpoint is that large",
        ) from None
    done = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    found = verify.parse_report(done.stdout)
    if found is None:
        raise VerifierFailed(
            f"the checkpoint verifier wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}",
            "check the trainer environment (`make env`) and the checkpoint directory",
        )
    return done.returncode, VerificationReport.model_validate(found)
