"""Lineage: each stage's final checkpoint, and its export, as KFP ``Model`` artifacts.

The train component outputs the stage's final checkpoint as a ``dsl.Model`` (:func:`checkpoint_model`);
verify_checkpoint and export take it as their input, so the pipelines UI's lineage graph (KFP's ML
Metadata, Vertex ML Metadata) shows train -> model -> verification -> export -> Hugging Face model.

The checkpoint stays where MaxText wrote it (the run directory, local or ``gs://``): the artifact's
file is a small JSON manifest (:func:`write_manifest`) and its metadata (shown in the UI) carry the
checkpoint's URI. KFP assigns the artifact's own URI (its pipeline root); a component that changes
``artifact.uri`` is honoured by kfp.local and Vertex but not documented for the KFP backend, so the
checkpoint's location is a metadata field (``checkpoint_uri``) rather than the artifact's URI.

Metadata of the checkpoint model (:data:`CHECKPOINT_FIELDS`): ``checkpoint_uri`` (the final step's
directory), ``checkpoint_dir``, ``step``, ``parameter_count`` (from the model's dimensions,
:func:`multislice.memory.model_dims`; the verifier checks it against the checkpoint),
``final_train_loss``, ``maxtext_version``, ``stage``, ``format`` (``orbax``); and, when the train
report or the prepare_data report has them, ``final_eval_loss`` and ``data_fingerprint``
(:func:`multislice.reports.data_fingerprint`).
"""

from __future__ import annotations

import json
from typing import Any

from multislice import maxtext, memory, storage
from multislice.errors import InputError
from multislice.plan import Plan, StagePlan
from multislice.reports import ExportReport, TrainReport, data_fingerprint

#: Fields every checkpoint model's metadata has (optional ones: ``final_eval_loss``, ``data_fingerprint``).
CHECKPOINT_FIELDS = (
    "stage", "format", "checkpoint_uri", "checkpoint_dir", "step", "parameter_count", "final_train_loss",
    "maxtext_version",
)  # fmt: skip
#: Fields every export model's metadata has.
EXPORT_FIELDS = (
    "stage", "format", "export_uri", "source_checkpoint_uri", "step", "parameter_count", "architecture",
    "logits_max_abs_diff", "logits_atol", "logits_rtol", "logits_check_passed", "maxtext_version",
)  # fmt: skip


def parameter_count(plan: Plan, stage: StagePlan) -> int | None:
    """The stage's model's parameter count from its dimensions (None when MaxText names an unknown model)."""
    dims = memory.model_dims(plan.spec.stage(stage.name))
    return dims.parameters if dims else None


def checkpoint_model(plan: Plan, stage: StagePlan, report: TrainReport) -> dict[str, Any]:
    """The metadata of the stage's final checkpoint as a ``Model`` artifact (see the module docstring)."""
    metadata: dict[str, Any] = {
        "stage": stage.name,
        "format": "orbax",
        "framework": "maxtext",
        "checkpoint_uri": storage.join(stage.checkpoint_dir, str(stage.final_step)),
        "checkpoint_dir": stage.checkpoint_dir,
        "step": stage.final_step,
        "parameter_count": parameter_count(plan, stage),
        "final_train_loss": report.final_loss,
        "maxtext_version": maxtext.MAXTEXT_VERSION,
        "skipped": report.skipped,
    }
    # When present: the train report's eval loss, the fingerprint of the data the stage trained on.
    eval_loss = getattr(report, "final_eval_loss", None)
    if eval_loss is not None:
        metadata["final_eval_loss"] = eval_loss
    fingerprint = data_fingerprint(plan, stage)
    if fingerprint:
        metadata["data_fingerprint"] = fingerprint
    return {k: v for k, v in metadata.items() if v is not None}


def export_model(stage: StagePlan, report: ExportReport) -> dict[str, Any]:
    """The metadata of the stage's export as a ``Model`` artifact."""
    check = report.logits_check or {}
    metadata: dict[str, Any] = {
        "stage": stage.name,
        "format": report.format,
        "framework": "transformers",
        "export_uri": report.export_dir,
        "source_checkpoint_uri": storage.join(stage.checkpoint_dir, str(stage.final_step)),
        "step": report.checkpoint_step,
        "parameter_count": report.parameter_count,
        "architecture": report.architecture,
        "vocab_size": report.vocab_size,
        "tokenizer": report.tokenizer,
        "files": report.files,
        "logits_max_abs_diff": check.get("max_abs_diff"),
        "logits_atol": check.get("atol"),
        "logits_rtol": check.get("rtol"),
        "logits_check_passed": check.get("passed"),
        "logits_max_abs_diff_by_loader": {
            (c.get("transformers_version") or name): c.get("max_abs_diff") for name, c in check["loaders"].items()
        }
        if check.get("loaders")
        else None,
        "dtype": report.dtype,
        "maxtext_version": maxtext.MAXTEXT_VERSION,
    }
    return {k: v for k, v in metadata.items() if v is not None}


def write_manifest(path: str, metadata: dict[str, Any]) -> str:
    """Write an artifact's file: its metadata as JSON (the artifact's payload; the model stays at its URI)."""
    storage.write_text(path, json.dumps(metadata, indent=1, sort_keys=True) + "\n")
    return path


def check_input(stage: StagePlan, metadata: dict[str, Any]) -> None:
    """Refuse a checkpoint model that is not this stage's (the pipeline wired another stage's train to it).

    Raises:
        multislice.errors.InputError: its ``checkpoint_dir`` or ``step`` differ from the plan's.
    """
    found = (metadata.get("checkpoint_dir"), metadata.get("step"))
    if found != (stage.checkpoint_dir, stage.final_step):
        raise InputError(
            f"the model input of stage {stage.name} is checkpoint {found[0]} step {found[1]}; this stage's is "
            f"{stage.checkpoint_dir} step {stage.final_step}",
            "wire the stage's own train task's model output into its verify_checkpoint and export tasks",
        )
