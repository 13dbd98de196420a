"""export: write a verified stage's final checkpoint in Hugging Face format and check it by its logits.

Runs after verify_checkpoint for a stage whose ``export`` is set (``huggingface``). The exporter
(:mod:`multislice.trainer.export`, trainer image) runs on the stage's final checkpoint in the process the verify
step started (:mod:`multislice.trainer.verify_export`), whose export report the backend returns
(:meth:`.Backend.run_exporter`; run alone when that process is not this run's): it writes
safetensors shards, ``config.json``, the stage's tokenizer and a model card to ``<stage_dir>/export/huggingface``
(local or ``gs://``), loads them with ``transformers.LlamaForCausalLM`` 5.x and 4.57 and compares each one's
logits with MaxText's on the same tokens. The report goes to ``<run_dir>/reports/<stage>/export.json``. A logits
mismatch (verdict FAIL) or an export that could not be made (ERROR) fails the step.
"""

from __future__ import annotations

from multislice import cancel
from multislice.backends import Backend
from multislice.errors import InputError, RunFailed
from multislice.heartbeat import heartbeat
from multislice.plan import Plan, StagePlan
from multislice.reports import ExportReport, report_path
from multislice.steps import backend_of, cancellable, say, stage_labels, teller, write_report


class ExportFailed(RunFailed):
    """The export's logits did not match MaxText's, or it could not be made; the message says which."""


def run(
    plan: Plan, stage: StagePlan, pipeline_run_id: str = "manual", *, backend: Backend | None = None
) -> ExportReport:
    """Export the final checkpoint of ``stage`` (one of ``plan.stages``; its ``export`` format) and check it;
    returns the exporter's report (PASS).

    Raises:
        multislice.errors.InputError: the stage has no ``export``.
        ExportFailed: verdict FAIL or ERROR.
        multislice.errors.RunFailed: the exporter left no report, or the backend cannot run it.
    """
    if not stage.export:
        raise InputError(f"stages.{stage.name}.export is not set", f"set stages.{stage.name}.export: huggingface")
    with cancellable("export", stage, stage_labels(plan, stage, pipeline_run_id), plan) as removal:
        removal.backend = backend = backend_of(plan, backend, "export", stage)
        what = f"{stage.export} export and logits check of {stage.checkpoint_dir} step {stage.final_step}"
        with heartbeat(what, teller("export", stage)) as beat:
            report = backend.run_exporter(plan, stage, pipeline_run_id, beat.tell)
        cancel.point("export:report")
        write_report(plan, report, stage)
        check = report.logits_check or {}
        if report.verdict != "PASS":
            raise ExportFailed(
                f"{stage.export} export of {stage.checkpoint_dir} step {stage.final_step} verdict {report.verdict}: "
                f"{report.error or check.get('detail', 'no detail')} "
                f"(report {report_path(plan, ExportReport.file_name, stage)})",
                "a FAIL means the converted weights do not compute MaxText's function: do not serve the export; "
                "an ERROR names what could not be read or written",
            )
        say(
            "export",
            f"PASS: {report.parameter_count:,} parameters in {report.export_dir} ({', '.join(report.files)}); "
            f"logits {check.get('detail', '')}",
            stage.name,
        )
        return report
