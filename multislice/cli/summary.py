"""The summary ``multislice run`` prints at the end of a run, read from the steps' reports."""

from __future__ import annotations

from pathlib import Path

from multislice import backends, goodput, reports, storage
from multislice.plan import Plan


def run_files(local_dir: Path, run_id: str) -> tuple[Path, Path]:
    """``(compiled pipeline, full log)`` of run ``run_id``: ``pipeline.<run id>.yaml`` and ``pipeline.<run id>.log``
    in ``local_dir``, so that a rerun of the same run_name (which resumes it) keeps the earlier run's."""
    return local_dir / f"pipeline.{run_id}.yaml", local_dir / f"pipeline.{run_id}.log"


def elastic_lines(train: reports.TrainReport) -> list[str]:
    """An elastic stage's story for the summary: each resize (when, why, from and to, steps lost).

    Empty for a stage that never resized. Times are seconds since training began (:class:`multislice.elastic.Resize`).
    """
    lines = []
    for resize in train.resizes:
        resumed = (
            f"resumed from step {resize.resumed_from_step} at {resize.resumed_at_seconds:.0f} s"
            if resize.resumed_at_seconds is not None and resize.resumed_from_step is not None
            else "not resumed"
        )
        lines.append(
            f"  resized       at {resize.detected_at_seconds:.0f} s: {resize.from_slices} -> {resize.to_slices} "
            f"slices ({resize.cause}); {resumed}, {resize.steps_lost} steps lost"
        )
    return lines


def goodput_lines(train: reports.TrainReport) -> list[str]:
    """A stage's goodput for the summary (every stage): goodput, then its badput by cause when measured.

    Goodput is productive training time over the job's time, 0-1, as Google's ml-goodput-measurement defines it
    (:mod:`multislice.goodput`); badput in seconds per cause. Empty for a report without goodput.
    """
    if train.goodput is None:
        return []
    lost = f", {train.steps_lost} steps trained again" if train.steps_lost else ""
    lines = [f"  goodput       {train.goodput:.2f} (productive training time / job time{lost})"]
    if train.job_seconds:
        lines.append(
            f"  badput        {goodput.badput_words(train.badput_seconds, train.job_seconds)} "
            f"of a {train.job_seconds:.0f} s job"
        )
    return lines


def summary_lines(plan: Plan, seconds: float, outcome: str, local_dir: Path, run_id: str) -> list[str]:
    """The run summary: per stage steps, loss, throughput, checkpoint, verification; where outputs live.

    Read from the steps' reports in the run directory (local or ``gs://``);
    ``local_dir`` holds this machine's files of run ``run_id`` (compiled pipeline, full log: :func:`run_files`).
    """
    reports_dir = storage.join(plan.run_dir, "reports")
    compiled, log = run_files(local_dir, run_id)
    lines = [f"run {plan.spec.run_name}: {outcome} in {seconds / 60:.1f} min"]
    for stage in plan.stages:
        checked = reports.read(reports.PreflightReport, plan, stage)
        train = reports.read(reports.TrainReport, plan, stage)
        verify = reports.read(reports.VerificationReport, plan, stage)
        lines.append(f"stage {stage.index + 1} {stage.name} ({stage.model_label}):")
        prepared = reports.read(reports.PrepareDataReport, plan, stage)
        if prepared and not prepared.skipped:
            manifest = prepared.manifest
            lines.append(
                f"  data          {manifest.get('token_count', 0):,} tokens in {manifest.get('shard_count')} shards "
                f"({'reused' if prepared.reused else 'tokenized'} in {prepared.seconds} s) at {prepared.uri}"
            )
        if checked and checked.verdict == "fits" and checked.bytes_per_chip and checked.target:  # a fit has both
            hbm = checked.bytes_per_chip.total
            lines.append(
                f"  preflight     fits: {hbm / 2**20:,.1f} MiB of {checked.hbm_bytes_per_chip / 2**30:.2f} GiB HBM "
                f"per chip on {checked.target.num_slices} x {checked.target.tpu_type} (AOT compile)"
            )
        elif checked:
            lines.append(f"  preflight     {checked.verdict}")
        if train and train.skipped:
            lines.append("  trained       nothing: its final checkpoint already existed")
        elif train and train.final_loss is not None:
            lines.append(
                f"  trained       {train.steps_trained}/{stage.steps} steps, loss {train.first_loss:.3f} -> "
                f"{train.final_loss:.3f}, {train.tokens_per_second_per_device:.1f} tokens/s per device, "
                f"{train.restarts} {backends.launcher_kind(train.launcher).restarts_are}"
            )
            lines.extend(f"  restart {n:<5} {cause}" for n, cause in enumerate(train.restart_causes, 1))
            lines.extend(elastic_lines(train))
            lines.extend(goodput_lines(train))
            if train.evals:
                lines.append(
                    f"  eval          loss {train.first_eval_loss:.3f} -> {train.final_eval_loss:.3f} "
                    f"(perplexity {train.final_eval_perplexity:.1f}) over {train.evals} evals"
                )
        else:
            lines.append("  trained       not completed")
        if verify and verify.latest_step is not None:
            lines.append(f"  checkpoint    step {verify.latest_step} at {stage.checkpoint_dir}/{verify.latest_step}")
        if verify:
            written = verify.written_mesh or {}
            mesh = ", ".join(f"{k}={v}" for k, v in written.items()) if isinstance(written, dict) else written
            dcn = ", ".join(f"{k}={v}" for k, v in stage.dcn.items() if v != 1) or "none, one slice"
            passed = sum(c.passed and not c.skipped for c in verify.checks)
            skipped = [c.name for c in verify.checks if c.skipped]
            lines.append(
                f"  verification  {verify.verdict} ({passed}/{len(verify.checks)} checks passed"
                + (f", {len(skipped)} SKIPPED: {', '.join(skipped)}" if skipped else "")
                + ", "
                f"{verify.parameter_count or 0:,} parameters, sharded over mesh {mesh}; DCN {dcn})"
            )
        else:
            lines.append("  verification  not run")
        if stage.export:
            exported = reports.read(reports.ExportReport, plan, stage)
            if exported and exported.logits_check:
                check = exported.logits_check
                loaders = check.get("loaders") or {"transformers": check}
                diffs = ", ".join(
                    f"{loader.get('transformers_version') or name} {loader.get('max_abs_diff', float('nan')):.2g}"
                    for name, loader in loaders.items()
                )
                dtype = f" ({exported.dtype})" if exported.dtype else ""
                lines.append(
                    f"  export        {exported.verdict}: {stage.export}{dtype} at {exported.export_dir}; logits vs "
                    f"MaxText's max |diff| by loader: {diffs} "
                    f"(tolerance {check.get('atol')} + {check.get('rtol')} x |logit|)"
                )
            else:
                lines.append(f"  export        {exported.verdict if exported else 'not run'}")
    lines += [
        f"outputs     {plan.run_dir}",
        f"reports     {reports_dir}/<stage>/(plan|prepare_data|preflight|admit|launch|train|verification).json",
        f"UI pages    {reports_dir}/<stage>/preflight.html (HBM per chip), train.html (loss and step-time plots), "
        "train.md, verification.md",
        f"pod logs    {backends.backend_class(plan.spec.backend).where_logs_are(plan)}",
        f"manifests   {plan.run_dir}/manifests/",
        f"pipeline    {compiled} (compiled), {log} (full log)",
    ]
    return lines
