"""The Hugging Face exporter as a process of this machine's trainer environment, alone or after the verifier.

A stage with ``export`` is verified and exported by one process (:func:`verify_and_export`, ``python -m
multislice.trainer.verify_export``): the verify step runs it, and its export report is handed to the export step
(:func:`hand_over`, :func:`take_over`), which runs the exporter alone (:func:`run`, ``python -m
multislice.trainer.export``) only when no report was handed over for its pipeline run. Each reads its JSON
report(s) from the process's output, as :mod:`.verifier` does for the checkpoint verifier.

The verify step takes the export's time too here: ``multislice run``'s kfp.local runs a pipeline's tasks one
at a time (kfp 2.17 ``kfp/local/orchestrator/dag_orchestrator.py``, ``run_dag``: the topologically sorted tasks
in a ``while`` loop), so nothing could run beside the export anyway, and one process pays the interpreter's start,
the imports of JAX, Orbax and MaxText and JAX's set-up once instead of twice.
"""

from __future__ import annotations

import contextlib
from typing import Any

from multislice import storage
from multislice.backends.local.environment import trainer_env
from multislice.backends.local.tools import Runner, report_of, run_tool
from multislice.errors import RunFailed
from multislice.plan import StagePlan
from multislice.reports import ExportReport, VerificationReport
from multislice.trainer import export, hub_token, verify_export


class ExporterFailed(RunFailed):
    """The exporter left no report (it could not start); the message has its exit status and output."""


def command(stage: StagePlan, hub_token_secret: str, card: dict[str, Any] | None, combined: bool) -> list[str]:
    """The exporter's command for the stage (``combined``: :mod:`multislice.trainer.verify_export`'s), wrapped by
    :func:`multislice.trainer.hub_token.command` when the token comes from Secret Manager."""
    python = str(trainer_env() / "bin" / "python")
    build = verify_export.command if combined else export.command
    argv = build(
        stage.checkpoint_dir, stage.final_step, str(stage.export_dir), list(stage.maxtext_args), python,
        dtype=stage.export_dtype, hub_repo=stage.export_hub_repo, report=stage.export_report, card=card,
        export_format=stage.export or "huggingface",
    )  # fmt: skip
    if stage.export_hub_repo and hub_token_secret:
        argv = hub_token.command(hub_token_secret, argv, python)
    return argv


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
    argv = command(stage, hub_token_secret, card, combined=False)
    done = run_tool(argv, timeout, "export:exporting", f"the Hugging Face export of {stage.checkpoint_dir}")
    return done.returncode, ExportReport.model_validate(report_of(done, ExporterFailed, "exporter"))


def verify_and_export(
    stage: StagePlan,
    timeout: float,
    hub_token_secret: str = "",
    card: dict[str, Any] | None = None,
    runner: Runner = run_tool,
) -> tuple[int, VerificationReport, ExportReport | None]:
    """Verify the stage's final checkpoint and, when its verdict is PASS, export it, in one process
    (:mod:`multislice.trainer.verify_export`; the export's options as :func:`run`'s; ``runner`` runs the command:
    a new process by default, :func:`.tools.run_tool`).

    Returns:
        ``(exit status, verification report, export report or None when the verdict was not PASS)``; the status
        is the verifier's unless PASS, then the exporter's.

    Raises:
        ExporterFailed: no verification report in its output (it could not start).
        multislice.backends.base.VerifierTimeout: it ran past ``timeout`` seconds (it was stopped).
        multislice.backends.local.environment.TrainerEnvMissing: no trainer environment.
    """
    argv = command(stage, hub_token_secret, card, combined=True)
    what = f"the checkpoint verifier and Hugging Face export of {stage.checkpoint_dir}"
    done = runner(argv, timeout, "verify_checkpoint:verifying", what)
    verification, exported = verify_export.reports_in(done.stdout)
    if verification is None:
        raise ExporterFailed(
            f"the checkpoint verifier (with the export) wrote no report (exit {done.returncode}):\n"
            f"{done.stderr[-3000:]}",
            "check the trainer environment (`make env`) and the checkpoint directory",
        )
    return (
        done.returncode,
        VerificationReport.model_validate(verification),
        None if exported is None else ExportReport.model_validate(exported),
    )


def handoff_path(stage: StagePlan) -> str:
    """Where the verify step leaves the export report for the export step: ``<stage_dir>/export/handoff.json``."""
    return storage.join(stage.stage_dir, "export", "handoff.json")


def hand_over(stage: StagePlan, pipeline_run_id: str, report: ExportReport) -> None:
    """Leave ``report`` for this pipeline run's export step of ``stage`` (:func:`take_over`)."""
    storage.write_json(
        handoff_path(stage),
        {"pipeline_run_id": pipeline_run_id, "checkpoint_dir": stage.checkpoint_dir, "step": stage.final_step,
         "report": report.to_dict()},
    )  # fmt: skip


def take_over(stage: StagePlan, pipeline_run_id: str) -> ExportReport | None:
    """The export report the verify step of pipeline run ``pipeline_run_id`` left for ``stage`` (removed as it is
    taken, so a later export step of the same run id exports again), or None: none, or another run's, another
    checkpoint's or another step's."""
    found = storage.read_json(handoff_path(stage))
    if not isinstance(found, dict):
        return None
    with contextlib.suppress(FileNotFoundError):
        storage.path(handoff_path(stage)).unlink()
    mine = (found.get("pipeline_run_id"), found.get("checkpoint_dir"), found.get("step")) == (
        pipeline_run_id, stage.checkpoint_dir, stage.final_step,
    )  # fmt: skip
    return ExportReport.model_validate(found["report"]) if mine else None
