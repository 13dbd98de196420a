"""prepare_data: tokenize a stage's raw text into ArrayRecord shards before preflight, or reuse earlier ones.

For a stage whose data is ``text`` (:class:`multislice.config.data.TextData`), the work
(:mod:`multislice.trainer.prepare_data`) needs the trainer environment's packages (MaxText's tokenizer,
tiktoken, array_record): it runs in this process when they are importable (the trainer image), else in
the local trainer environment (``.venvs/trainer``) as a child process. The shards go to the stage's
``data_dir`` (:func:`multislice.plan.prepared_dir`), which the stage's MaxText arguments read
(``grain_train_files``, ``grain_eval_files``); a rerun on unchanged sources and tokenizer reuses them and
says so. Other data kinds need no preparation: the step reports ``skipped``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

from multislice import cancel
from multislice.backends import Backend
from multislice.config import Stage
from multislice.config.data import TextData
from multislice.config.models import data_lasts_issue
from multislice.errors import InputError, RunFailed
from multislice.plan import Plan, StagePlan, reads_packed
from multislice.reports import PrepareDataReport
from multislice.steps import backend_of, cancellable, teller, write_report


class PrepareDataFailed(RunFailed):
    """Tokenizing the stage's text failed; the message holds the last lines of the work's output."""


def _in_process() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("maxtext", "array_record", "tiktoken"))


def _request(stage: StagePlan, spec: Stage) -> dict:
    return {
        "data": spec.data.model_dump(mode="json"),
        "tokenizer": spec.tokenizer.model_dump(mode="json"),
        "max_target_length": spec.max_target_length,
        "out_dir": stage.data_dir,
    }


def _run_in_trainer_env(request: dict, tell) -> dict:
    from multislice.backends.local.environment import trainer_env, trainer_process_env  # the local backend: local runs

    env_dir = trainer_env()
    env = trainer_process_env(env_dir)
    # This package, from where this process has it (a worktree or an install), first on the child's path.
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    command = [
        str(env_dir / "bin" / "python"),
        "-m",
        "multislice.trainer.prepare_data",
        "--request",
        json.dumps(request),
    ]
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as process:
        assert process.stdout is not None  # stdout=PIPE
        try:
            for line in process.stdout:
                line = line.rstrip("\n")
                lines.append(line)
                if line.startswith("prepare_data: "):
                    tell(line.removeprefix("prepare_data: "))
        except cancel.Cancelled:
            process.terminate()
            raise
    manifest = next(
        (json.loads(x.removeprefix("MANIFEST ")) for x in reversed(lines) if x.startswith("MANIFEST ")), None
    )
    if process.returncode != 0 or manifest is None:
        tail = "\n".join(lines[-15:])
        raise PrepareDataFailed(
            f"prepare_data exited with status {process.returncode}; its last lines:\n{tail}",
            "fix the cause above (the data spec's files, their format, the tokenizer), then rerun",
        )
    return manifest


def run(
    plan: Plan, stage: StagePlan, pipeline_run_id: str = "", *, backend: Backend | None = None
) -> PrepareDataReport:
    """Prepare the data of ``stage`` (one of ``plan.stages``; ``text``: tokenize into shards, or reuse them);
    returns the report.

    With ``pipeline_run_id`` on GKE the step holds the run meanwhile (the run Lease, through ``backend`` or the
    plan's: :func:`multislice.steps.cancellable`), as every step does: tokenizing may outlast the Lease.

    Raises:
        PrepareDataFailed: tokenizing failed (unreadable file, no document in a split, ...).
        multislice.backends.local.environment.TrainerEnvMissing: neither this process nor a local
            trainer environment has MaxText.
    """
    with cancellable("prepare_data", stage, plan=plan, run_id=pipeline_run_id) as removal:
        if pipeline_run_id and plan.spec.backend == "gke":
            removal.backend = backend_of(plan, backend, "prepare_data", stage)
            cancel.point("prepare_data:holding")
        spec = plan.spec.stage(stage.name)
        tell = teller("prepare_data", stage)
        if not isinstance(spec.data, TextData) or stage.data_dir is None:
            tell(f"nothing to prepare: the stage's data is {spec.data.kind}")
            return write_report(plan, PrepareDataReport(skipped=True), stage)
        request = _request(stage, spec)
        if _in_process() and not os.environ.get("MULTISLICE_PREPARE_DATA_SUBPROCESS"):
            from multislice.trainer import prepare_data as work  # numpy, tokenizers: only when run here

            try:
                manifest = work.prepare(spec.data, spec.tokenizer, spec.max_target_length, stage.data_dir, say=tell)
            except (OSError, ValueError) as error:
                raise PrepareDataFailed(f"prepare_data failed: {error}", "fix the data spec or its files") from error
        else:
            manifest = _run_in_trainer_env(request, tell)
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
