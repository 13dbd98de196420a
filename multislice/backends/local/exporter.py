"""The Hugging Face exporter as a process of this machine's trainer environment.

Runs ``python -m multislice.trainer.export`` (:func:`multislice.trainer.export.command`) and reads its
JSON report from the process's output, as :mod:`.verifier` does for the checkpoint verifier.
"""

from __future__ import annotations

import subprocess

from multislice import cancel
from multislice.backends.base import VerifierTimeout
from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.cancel import die_with_parent
from multislice.errors import RunFailed
from multislice.plan import StagePlan
from multislice.reports import ExportReport
from multislice.trainer import export
from multislice.trainer.verify import parse_report


class ExporterFailed(RunFailed):
    """The exporter left no report (it could not start); the message has its exit status and output."""


def run(stage: StagePlan, timeout: float) -> tuple[int, ExportReport]:
    """Export the stage's final checkpoint to ``stage.export_dir`` and check its logits.

    Returns:
        ``(exit status, report)``: 0 PASS, 1 FAIL (logits differ), 2 the export could not be made.

    Raises:
        ExporterFailed: no report in its output.
        multislice.backends.base.VerifierTimeout: it ran past ``timeout`` seconds (it was stopped).
        multislice.backends.local.environment.TrainerEnvMissing: no trainer environment.
    """
    env = trainer_env()
    argv = export.command(
        stage.checkpoint_dir, stage.final_step, str(stage.export_dir), list(stage.maxtext_args),
        str(env / "bin" / "python"),
    )  # fmt: skip
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=trainer_process_env(env),
        preexec_fn=die_with_parent(),  # a SIGKILLed step's exporter goes with it
    )  # fmt: skip
    try:
        cancel.point("export:exporting")
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException as error:  # a timeout, or a cancel (multislice.cancel.Cancelled): stop it first
        process.kill()
        process.communicate()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        raise VerifierTimeout(
            f"the Hugging Face export of {stage.checkpoint_dir} ran past {timeout:.0f} s and was stopped",
            "raise timeouts.verify if the checkpoint is that large",
        ) from None
    found = parse_report(stdout)
    if found is None:
        raise ExporterFailed(
            f"the exporter wrote no report (exit {process.returncode}):\n{stderr[-3000:]}",
            "check the trainer environment (`make env`) and the checkpoint directory",
        )
    return process.returncode, ExportReport.model_validate(found)
