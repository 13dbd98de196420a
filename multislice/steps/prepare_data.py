"""prepare_data: tokenize a stage's raw text into ArrayRecord shards before preflight, or reuse earlier ones.

For a stage whose data is ``text`` (:class:`multislice.config.data.TextData`), this step is the coordinator of
:mod:`multislice.trainer.prepare_shards`: it lists the sources with what the store knows of them (no byte of a
``gs://`` object read; local files' SHA-256 cached by their stat), and reuses the shards in the stage's
``data_dir`` (:func:`multislice.plan.prepared_dir`) when their manifest has the same fingerprint. Else it
splits the sources into ``data.workers`` ranges, has the backend run one shard worker per range in the trainer
image (:meth:`multislice.backends.base.Backend.run_data_workers`: processes locally, an Indexed Job on GKE; the
step never asks which), and assembles their parts into ``data_dir``, which the stage's MaxText arguments read
(``grain_train_files``, ``grain_eval_files``). Other data kinds need no preparation: the step reports ``skipped``.
"""

from __future__ import annotations

import dataclasses
import time

from multislice import cancel
from multislice.backends import Backend
from multislice.config import Stage
from multislice.config.data import SITE_PACKAGES_PREFIX, TextData
from multislice.config.models import data_lasts_issue
from multislice.errors import InputError, RunFailed
from multislice.heartbeat import heartbeat
from multislice.plan import Plan, StagePlan, reads_packed
from multislice.reports import PrepareDataReport
from multislice.steps import backend_of, cancellable, stage_labels, teller, write_report
from multislice.steps.plan import trainer_site_packages
from multislice.trainer import prepare_shards


class PrepareDataFailed(RunFailed):
    """Tokenizing the stage's text failed; the message says why (a worker's last lines, a split with no document)."""


def _gke_sources(stage: StagePlan, data: TextData) -> None:
    """On GKE the shard workers are pods: every source must be where a pod reads it (``gs://``).

    Raises:
        InputError: a glob names a local path or the trainer environment's ``site-packages:``.
    """
    for index, pattern in enumerate(data.files):
        if not pattern.startswith("gs://"):
            where = "the trainer image's site-packages" if pattern.startswith(SITE_PACKAGES_PREFIX) else "a local path"
            raise InputError(
                f"stages.{stage.name}.data.files[{index}] is {pattern!r}, {where}: on GKE prepare_data's shard "
                "workers are pods, which read their sources from Cloud Storage",
                "copy the corpus to a gs:// bucket the trainer's service account may read and give its glob",
            )


def _prepare(plan: Plan, stage: StagePlan, spec: Stage, pipeline_run_id: str, backend: Backend | None, tell) -> dict:
    """List, reuse or run the shard workers and assemble; the manifest."""
    started = time.monotonic()
    data, out_dir = spec.data, stage.data_dir
    assert isinstance(data, TextData) and out_dir is not None  # run() checked
    if plan.spec.backend == "gke":
        _gke_sources(stage, data)
    try:
        sources = prepare_shards.list_sources(data, trainer_site_packages() if plan.spec.backend == "local" else None)
    except FileNotFoundError as error:
        raise PrepareDataFailed(f"prepare_data failed: {error}", "fix data.files") from error
    wanted = prepare_shards.fingerprint_of(data, spec.tokenizer, spec.max_target_length, sources)
    old = prepare_shards.reusable(out_dir, wanted)
    if old is not None:
        old.update(reused=True, seconds=round(time.monotonic() - started, 2))
        tell(
            f"reusing {old['shard_count']} shards in {out_dir}: same {len(sources)} source files (SHA-256 locally, "
            f"CRC32C and size on gs://) and tokenizer, {old['token_count']:,} tokens; nothing tokenized"
        )
        return old
    request = prepare_shards.work_request(data, spec.tokenizer, spec.max_target_length, out_dir, sources)
    tell(
        f"tokenizing {len(sources)} files ({sum(int(s['bytes']) for s in sources):,} bytes) with "
        f"{spec.tokenizer.path} on {request['workers']} shard workers"
    )
    runner = backend_of(plan, backend, "prepare_data", stage)
    with heartbeat(f"{request['workers']} shard workers tokenizing {len(sources)} files", tell) as beat:
        exits = runner.run_data_workers(plan, stage, request, pipeline_run_id, beat.tell)
        cancel.point("prepare_data:assemble")
        beat.phase(f"assembling the shards of {len(sources)} files into {out_dir}")
        try:
            manifest = prepare_shards.assemble(request, started, beat.tell)
        except (OSError, ValueError) as error:
            raise PrepareDataFailed(f"prepare_data failed: {error}", "fix the data spec or its files") from error
    manifest["worker_exits"] = [dataclasses.asdict(e) for e in exits]  # in the report; not in the stored manifest
    return manifest


def run(
    plan: Plan, stage: StagePlan, pipeline_run_id: str = "", *, backend: Backend | None = None
) -> PrepareDataReport:
    """Prepare the data of ``stage`` (one of ``plan.stages``; ``text``: tokenize into shards, or reuse them);
    returns the report.

    With ``pipeline_run_id`` on GKE the step holds the run meanwhile (the run Lease, through ``backend`` or the
    plan's: :func:`multislice.steps.cancellable`), as every step does: tokenizing may outlast the Lease.

    Raises:
        PrepareDataFailed: the globs match no file, or a split got no document.
        multislice.backends.base.DataWorkersFailed: a shard worker failed (unreadable file, bad tokenizer, ...).
        InputError: on GKE, a source not on ``gs://``; the tokenizer's vocabulary is not the model's; the data
            does not last the stage's steps.
        multislice.backends.local.environment.TrainerEnvMissing: locally, no trainer environment.
    """
    labels = stage_labels(plan, stage, pipeline_run_id) if pipeline_run_id else None
    with cancellable("prepare_data", stage, labels, plan=plan, run_id=pipeline_run_id) as removal:
        if pipeline_run_id and plan.spec.backend == "gke":
            removal.backend = backend_of(plan, backend, "prepare_data", stage)
            cancel.point("prepare_data:holding")
        spec = plan.spec.stage(stage.name)
        tell = teller("prepare_data", stage)
        if not isinstance(spec.data, TextData) or stage.data_dir is None:
            tell(f"nothing to prepare: the stage's data is {spec.data.kind}")
            return write_report(plan, PrepareDataReport(skipped=True), stage)
        manifest = _prepare(plan, stage, spec, pipeline_run_id, removal.backend or backend, tell)
        if (
            manifest.get("tokenizer", {}).get("vocab_size") not in (None, spec.model.vocab_size)
            and spec.model.vocab_size
        ):
            raise InputError(
                f"stages.{stage.name}.model.vocab_size is {spec.model.vocab_size} but the tokenizer has "
                f"{manifest['tokenizer']['vocab_size']} tokens",
                f"set model.vocab_size: {manifest['tokenizer']['vocab_size']}",
            )
        # The rows MaxText makes of the records: packed first-fit, at least ceil(tokens / max_target_length);
        # unpacked (elastic stages, packing: false, concatenated records), one a record.
        train = manifest.get("splits", {}).get("train", {})
        train_sequences = train.get("rows_packed_at_least") if reads_packed(spec) else train.get("sequences")
        lasts = train_sequences is not None and data_lasts_issue(spec, train_sequences, stage.global_batch_size)
        if lasts:
            raise InputError(
                f"stages.{stage.name}.{lasts.split('; ', 1)[0]} (prepared at {stage.data_dir})",
                lasts.split("; ", 1)[1],
            )
        cancel.point("prepare_data:report")
        report = PrepareDataReport(
            uri=stage.data_dir, reused=bool(manifest.get("reused")), seconds=manifest.get("seconds"), manifest=manifest
        )
        return write_report(plan, report, stage)
