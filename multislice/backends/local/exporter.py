"""The Hugging Face exporter as a process of this machine's trainer environment.

Runs ``python -m multislice.trainer.export`` (:func:`multislice.trainer.export.command`) and reads its
JSON report from the process's output, as :mod:`.verifier` does for the checkpoint verifier.
"""

from __future__ import annotations

from typing import Any

from multislice.backends.local.environment import trainer_env
from multislice.backends.local.tools import report_of, run_tool
from multislice.errors import RunFailed
from multislice.plan import StagePlan
from multislice.reports import ExportReport
from multislice.trainer import export, hub_token


class ExporterFailed(RunFailed):
    """The exporter left no report (it could not start); the message has its exit status and output."""


def run(
    stage: StagePlan, timeout: float, hub_token_secret: str = "", card: dict[str, Any] | None = None
) -> tuple[int, ExportReport]:
    """Export the stage's final checkpoint to ``stage.export_dir`` and check its logits.

    With the same options as the GKE export Job: the stage's dtype, Hub repository and report copy. The Hub token
    is this machine's ``$HF_TOKEN`` (the process inherits the environment), or, with ``hub_token_secret``, read
    from Secret Manager with this machine's Google credentials by :mod:`multislice.trainer.hub_token`. ``card``: the
    model card's facts (:func:`multislice.reports.model_card`).

    Returns:
        ``(exit status, report)``: 0 PASS, 1 FAIL (logits differ), 2 the export could not be made.

    Raises:
        ExporterFailed: no report in its output.
        multislice.backends.base.VerifierTimeout: it ran past ``timeout`` seconds (it was stopped).
        multislice.backends.local.environment.TrainerEnvMissing: no trainer environment.
    """
    python = str(trainer_env() / "bin" / "python")
    argv = export.command(
        stage.checkpoint_dir, stage.final_step, str(stage.export_dir), list(stage.maxtext_args), python,
        dtype=stage.export_dtype, hub_repo=stage.export_hub_repo, report=stage.export_report, card=card,
    )  # fmt: skip
    if stage.export_hub_repo and hub_token_secret:
        argv = hub_token.command(hub_token_secret, argv, python)
    done = run_tool(argv, timeout, "export:exporting", f"the Hugging Face export of {stage.checkpoint_dir}")
    return done.returncode, ExportReport.model_validate(report_of(done, ExporterFailed, "exporter"))
