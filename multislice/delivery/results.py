"""A run's results read back from its run directory (local path or ``gs://``): the steps' reports.

Each step writes its report to ``<output_dir>/<run_name>/reports/<stage>/<step>.json``
(:mod:`multislice.reports`): ``train.json`` holds the training metrics the
train step also logs as KFP Metrics (steps trained, first and final loss,
step time in seconds, tokens/s and TFLOP/s per device, JobSet restarts),
``verification.json`` the checkpoint verifier's verdict, ``export.json`` the
Hugging Face export's verdict and directory. Reading them back
needs no pipelines API (KFP's v2beta1 API does not serve metric values; they
live in its ML Metadata store), only read access to the run directory,
through :mod:`multislice.storage` (``gs://`` by gcsfs, which honours
``STORAGE_EMULATOR_HOST``).

For notebooks, a :class:`RunRef` names a run wherever it ran (local, KFP,
Vertex AI): :func:`stages`, :func:`metrics`, :func:`curves` and
:func:`checkpoints` read it; :func:`compare_table` and :func:`plot` put
several runs side by side (train and eval loss); :func:`wait` follows one with
progress lines and :func:`cancel` stops it; :func:`load_hf_model` loads a
stage's exported model with transformers.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from multislice import config, identity, storage
from multislice import metrics as metric_records
from multislice.delivery.artifacts import markdown_table
from multislice.errors import InputError, UserError, translated
from multislice.reports import (
    ExportReport,
    PlanReport,
    StepReport,
    TrainReport,
    VerificationReport,
    parse,
    report_path,
)
from multislice.trainer import hf_loader

#: The reports :func:`read_run` returns per stage: key -> report type.
STAGE_REPORTS: dict[str, type[StepReport]] = {
    "train": TrainReport,
    "verification": VerificationReport,
    "export": ExportReport,
}


class StageReports(TypedDict, total=False):
    """One stage's reports, as :func:`read_run` returns them (keys of :data:`STAGE_REPORTS`); one not written is
    left out."""

    train: TrainReport
    verification: VerificationReport
    export: ExportReport


def _read_report[R: StepReport](run_dir: str, kind: type[R], stage: str) -> R | None:
    """One report of a stage from the run directory, or None when it is not there."""
    data = storage.read_json(report_path(run_dir, kind.file_name, stage))
    return None if data is None else parse(kind, data)


def read_run(output_dir: str, run_name: str, stages: list[str]) -> dict[str, StageReports]:
    """Every stage's reports of a run: ``{stage: {"train": TrainReport, "verification": ..., "export": ...}}``.

    Args:
        output_dir: The run's ``output_dir`` parameter (local path or ``gs://``).
        run_name: The run's name (for a scheduled run, the name with its ID appended).
        stages: Stage names, in order (``[s.name for s in spec.stages]``).

    Returns:
        A report missing from the run directory (a stage not reached, or
        skipped) is left out of its stage's mapping.
    """
    run_dir = identity.run_dir(output_dir, run_name)
    results: dict[str, StageReports] = {}
    for stage in stages:
        found = results[stage] = StageReports()
        if (train := _read_report(run_dir, TrainReport, stage)) is not None:
            found["train"] = train
        if (verification := _read_report(run_dir, VerificationReport, stage)) is not None:
            found["verification"] = verification
        if (export := _read_report(run_dir, ExportReport, stage)) is not None:
            found["export"] = export
    return results


# -- following and comparing runs (notebooks) ---------------------------------------------------------------------

#: States after which a run changes no more (KFP v2beta1 ``V2beta1RuntimeState``; Vertex ``PipelineState`` names).
FINAL_STATES = {"SUCCEEDED", "FAILED", "SKIPPED", "CANCELED", "CANCELLED", "PAUSED"}


@dataclass
class RunRef:
    """A run whose results can be read: where it writes, its stages, and where it runs.

    Attributes:
        run_name: The run's name (its directory under ``output_dir``).
        output_dir: The ``output_dir`` parameter (local path or ``gs://``).
        stages: Stage names, in order.
        target: ``local``, ``kfp`` or ``vertex``.
        run_id: KFP run ID or Vertex PipelineJob resource name; '' for a local run.
        url: The run's page (KFP UI or the Google Cloud console); '' when unknown.
        handle: The service's object (``aiplatform.PipelineJob``; for KFP the ``kfp.Client``), for wait and cancel.
    """

    run_name: str
    output_dir: str
    stages: list[str]
    target: str = "local"
    run_id: str = ""
    url: str = ""
    handle: Any = field(default=None, repr=False)

    @property
    def run_dir(self) -> str:
        """``<output_dir>/<run_name>``."""
        return identity.run_dir(self.output_dir, self.run_name)


def from_run_dir(output_dir: str, run_name: str) -> RunRef:
    """A :class:`RunRef` for a run already made, from its run directory alone (a local run's, or any
    ``gs://`` one): its stages from the plan report the plan step wrote (``reports/plan.json``, or a
    stage's ``reports/<stage>/plan.json``).

    Raises:
        multislice.errors.InputError: no run directory there, or one without a plan report.
    """
    run_dir = identity.run_dir(output_dir, run_name)
    base = storage.path(storage.join(run_dir, "reports"))
    if not storage.path(run_dir).is_dir():
        raise InputError(f"no run directory {run_dir}", "check output_dir and the run's run_name")
    found = [base / PlanReport.file_name, *sorted(base.glob(f"*/{PlanReport.file_name}"))] if base.is_dir() else []
    for path in found:
        data = storage.read_json(str(path))
        if data is not None:
            plan = parse(PlanReport, data).plan
            return RunRef(run_name, output_dir, [s.name for s in plan.spec.stages])
    raise InputError(f"run directory {run_dir} has no plan report", "the run stopped before its plan step; rerun it")


def run_url(target: str, run_id: str, *, host: str = "", project: str = "", location: str = "") -> str:
    """The run's page: KFP UI ``<host>/#/runs/details/<id>`` (the UI's route), or the console's Vertex AI run page.

    ``host`` is the KFP endpoint as the user reaches the UI (the UI serves the API under the same host);
    ``run_id`` for Vertex is the PipelineJob's resource name or ID.
    """
    if target == "kfp":
        return f"{host.rstrip('/')}/#/runs/details/{run_id}"
    job = run_id.rsplit("/", 1)[-1]
    return f"https://console.cloud.google.com/vertex-ai/locations/{location}/pipelines/runs/{job}?project={project}"


@translated
def from_submitted(submitted: Any, profile: str | Mapping[str, Any], *, kfp: Any = None, vertex: Any = None) -> RunRef:
    """A :class:`RunRef` for what :func:`multislice.submit` returned (run name and output_dir from what was sent).

    Args:
        submitted: The :class:`multislice.delivery.submission.SubmittedRun`.
        profile: The profile it was submitted from (its stage names).
        kfp, vertex: The target's settings (the run's URL; KFP: the client that waits and cancels).
    """
    data = config.read_profile(profile) if isinstance(profile, str) else profile
    stages = [s["name"] for s in data["stages"]]
    output_dir = str(submitted.parameters.get("output_dir") or data.get("output_dir"))
    if submitted.target == "kfp":
        url = run_url("kfp", submitted.run_id, host=kfp.host if kfp else "")
        handle = kfp.make_client() if kfp else None
    else:
        url = run_url("vertex", submitted.run_id, project=vertex.project if vertex else "",
                      location=vertex.location if vertex else "")  # fmt: skip
        handle = submitted.job
    return RunRef(submitted.run_name, output_dir, stages, submitted.target, submitted.run_id, url, handle)


@translated
def from_kfp(client: Any, run_id: str, profile: str | Mapping[str, Any], host: str = "") -> RunRef:
    """A :class:`RunRef` for any KFP run of this pipeline, from the parameters the run was given."""
    data = config.read_profile(profile) if isinstance(profile, str) else profile
    run = client.get_run(run_id)
    params = dict((run.runtime_config.parameters if run.runtime_config else None) or {})
    run_name = str(params.get("run_name") or run.display_name)
    output_dir = str(params.get("output_dir") or data.get("output_dir"))
    stage_names = [s["name"] for s in data["stages"]]
    return RunRef(run_name, output_dir, stage_names, "kfp", run_id, run_url("kfp", run_id, host=host), client)


@translated
def state(run: RunRef) -> str:
    """The run's state as the service reports it (``RUNNING``, ``SUCCEEDED``...); ``LOCAL`` for a local run.

    Raises:
        multislice.errors.UserError: the KFP endpoint cannot be reached or refuses, no Google Cloud credentials,
            or Vertex AI refuses (:func:`multislice.errors.expected_error`: the cause and fix the CLI prints).
    """
    if run.target == "kfp":
        return str(run.handle.get_run(run.run_id).state)
    if run.target == "vertex":
        return run.handle.state.name.removeprefix("PIPELINE_STATE_")
    return "LOCAL"


@translated
def wait(
    run: RunRef,
    *,
    timeout: float = 24 * 3600.0,
    poll_seconds: float = 30.0,
    tell: Any = print,
    clock: Any = time.monotonic,
    pause: Any = time.sleep,
) -> str:
    """Wait for the run to end, telling each state change and the stages reported so far; its final state.

    Unlike ``kfp.Client.wait_for_run_completion`` (silent until the end), each
    poll that sees something new tells one line: the state, and each stage as
    its train or verification report appears in the run directory.

    Raises:
        TimeoutError: not ended within ``timeout`` seconds (the run goes on; :func:`cancel` stops it).
        multislice.errors.UserError: the service cannot be reached or refuses (as :func:`state`).
    """
    started, told_state, seen = clock(), None, set()
    while True:
        now_state = state(run)
        if now_state != told_state:
            tell(f"{run.run_name}: {now_state} ({clock() - started:.0f} s)")
            told_state = now_state
        for stage, found in read_run(run.output_dir, run.run_name, run.stages).items():
            for key, report in found.items():
                if (stage, key) not in seen:
                    seen.add((stage, key))
                    tell(f"{run.run_name}: stage {stage} {key} reported, {_told(report)}")
        if now_state in FINAL_STATES:
            return now_state
        if clock() - started > timeout:
            raise TimeoutError(f"run {run.run_name} still {now_state} after {timeout:.0f} s; see {run.url}")
        pause(poll_seconds)


def _told(report: object) -> str:
    """What :func:`wait` tells of a stage's report: a train report's final loss, else its verdict (and export)."""
    if isinstance(report, TrainReport):
        return f"final loss {report.final_loss:.3f}"
    if isinstance(report, ExportReport) and report.export_dir:
        return f"verdict {report.verdict} at {report.export_dir}"
    if isinstance(report, VerificationReport | ExportReport):
        return f"verdict {report.verdict}"
    return type(report).__name__


@translated
def cancel(run: RunRef) -> None:
    """Stop the run: KFP ``terminate_run``; Vertex ``PipelineJob.cancel``. Its exit handler deletes its JobSets."""
    if run.target == "kfp":
        run.handle.terminate_run(run.run_id)
    elif run.target == "vertex":
        run.handle.cancel()
    else:
        raise ValueError("a local run is stopped with Ctrl-C in its `multislice run` (or `multislice cleanup`)")


def stages(run: RunRef) -> list[dict[str, Any]]:
    """Each stage: ``stage``, ``status`` (``verified``, ``trained``, ``not reached``), steps and latest checkpoint."""
    found = read_run(run.output_dir, run.run_name, run.stages)
    saved = checkpoints(run)
    rows = []
    for stage in run.stages:
        reports = found.get(stage, {})
        status = "verified" if "verification" in reports else "trained" if "train" in reports else "not reached"
        train = reports.get("train")
        rows.append({"stage": stage, "status": status, "steps": train.steps_trained if train else None,
                     "latest_checkpoint": saved[stage][-1] if saved[stage] else None})  # fmt: skip
    return rows


def metrics(run: RunRef) -> dict[str, dict[str, Any]]:
    """Each stage's training metrics (:class:`multislice.reports.TrainReport` fields, eval loss and perplexity
    among them), its checkpoint verdict (``verdict``), and its export's verdict and directory (``export``,
    ``export_dir``; None where the stage exports nothing or has not yet)."""
    out = {}
    for stage, found in read_run(run.output_dir, run.run_name, run.stages).items():
        train, verification, export = found.get("train"), found.get("verification"), found.get("export")
        out[stage] = {
            **(train.to_dict() if train else {}),
            "verdict": verification.verdict if verification else None,
            "export": export.verdict if export else None,
            "export_dir": export.export_dir if export else None,
        }
    return out


#: Each curve's step and loss keys in MaxText's metrics records.
CURVE_KEYS = {"train": ("step", "learning/loss"), "eval": ("eval_after_step", "eval/avg_loss")}


def curves(run: RunRef, kind: str = "train") -> dict[str, list[tuple[int, float]]]:
    """Each stage's loss curve ``[(step, loss)]`` from its metrics file (the last record of a step wins).

    Args:
        kind: ``train`` (MaxText's ``learning/loss`` per step) or ``eval`` (``eval/avg_loss``, mean
            cross-entropy per target token in nats, at each ``eval_after_step``).

    Raises:
        ValueError: ``kind`` is neither.
    """
    if kind not in CURVE_KEYS:
        raise ValueError(f"kind {kind!r}: use 'train' or 'eval'")
    return {stage: found[kind] for stage, found in _stage_curves(run).items()}


def _stage_curves(run: RunRef) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{stage: {kind: [(step, loss)]}}`` for every kind of :data:`CURVE_KEYS`, each metrics file read once."""
    out = {}
    for stage in run.stages:
        try:
            records = metric_records.read_records(storage.join(run.run_dir, stage, "metrics.jsonl"))
        except FileNotFoundError:
            records = []
        out[stage] = {
            kind: sorted({int(r[step]): float(r[loss]) for r in records if step in r and loss in r}.items())
            for kind, (step, loss) in CURVE_KEYS.items()
        }
    return out


def checkpoints(run: RunRef) -> dict[str, list[int]]:
    """Each stage's committed checkpoint steps (Orbax's committed step directories), ascending."""
    return {s: storage.committed_steps(storage.join(run.run_dir, s, "checkpoints")) for s in run.stages}


COMPARE_COLUMNS = {
    "run": "run",
    "stage": "stage",
    "steps_trained": "steps",
    "first_loss": "first loss",
    "final_loss": "final loss",
    "final_eval_loss": "final eval loss",
    "final_eval_perplexity": "eval perplexity",
    "tokens_per_second_per_device": "tokens/s per device",
    "restarts": "restarts",
    "verdict": "checkpoint",
    "export": "export",
}


def compare(runs: Sequence[RunRef]) -> list[dict[str, Any]]:
    """One row per run and stage: the run's name, the stage and its metrics (:func:`metrics`)."""
    return [{"run": run.run_name, "stage": stage, **found} for run in runs for stage, found in metrics(run).items()]


def compare_table(runs: Sequence[RunRef]) -> str:
    """:func:`compare` as a Markdown table (``IPython.display.Markdown`` shows it in a notebook)."""
    return markdown_table(compare(runs), COMPARE_COLUMNS)


def plot(runs: Sequence[RunRef]) -> Any:
    """One matplotlib figure: a loss-vs-step axes per stage, a line per run (its train loss) and, where the
    stage evaluates, a dashed line of the same colour labelled ``<run> eval`` (its eval loss). Returns the figure."""
    import matplotlib

    if "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stage_names = list(dict.fromkeys(s for run in runs for s in run.stages))
    figure, axes = plt.subplots(1, len(stage_names), figsize=(5 * len(stage_names), 3.5), squeeze=False)
    for run in runs:
        found = _stage_curves(run)
        for ax, stage in zip(axes[0], stage_names, strict=True):
            points, eval_points = found.get(stage, {}).get("train", []), found.get(stage, {}).get("eval", [])
            colour = None
            if points:
                [line] = ax.plot([p[0] for p in points], [p[1] for p in points], label=run.run_name)
                colour = line.get_color()
            if eval_points:
                ax.plot([p[0] for p in eval_points], [p[1] for p in eval_points], linestyle="--", marker=".",
                        color=colour, label=f"{run.run_name} eval")  # fmt: skip
    for ax, stage in zip(axes[0], stage_names, strict=True):
        ax.set_title(stage)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        if ax.lines:
            ax.legend(fontsize="small")
    figure.tight_layout()
    return figure


def load_hf_model(run: RunRef, stage: str, local_dir: str | None = None, **from_pretrained: Any) -> tuple[Any, Any]:
    """The stage's exported model and tokenizer, loaded with transformers: ``(model, tokenizer)``.

    Reads the stage's ``export.json`` (the export step's report) and loads its ``export_dir`` with
    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` (transformers 4.57 or 5,
    with torch, in the calling Python; the pipeline environment has neither, the trainer environment both).
    A ``gs://`` export is copied to ``local_dir`` (a new temporary directory when None) first: an 8B
    export in bfloat16 is about 16 GB on disk and in memory.

    Args:
        run: The run (:class:`RunRef`).
        stage: One of ``run.stages``.
        local_dir: Where a ``gs://`` export is copied to.
        from_pretrained: Passed to both ``from_pretrained`` calls (e.g. ``device_map``).

    Raises:
        multislice.errors.InputError: ``stage`` is not one of the run's, or transformers or torch is not installed
            here (checked before anything is copied).
        multislice.errors.UserError: the stage has no export (not reached, or ``stages.N.export`` unset), or its
            export did not pass (``export.json``'s verdict and error are in the message).
    """
    if stage not in run.stages:
        raise InputError(f"stage {stage!r} is not a stage of run {run.run_name}", f"use one of {run.stages}")
    found = read_run(run.output_dir, run.run_name, [stage])[stage].get("export")
    if found is None:
        raise UserError(
            f"stage {stage} of run {run.run_name} has no export report under {run.run_dir}/reports/{stage}",
            "set the stage's `export` in the profile (stages.N.export) and run it, or wait for its export step",
        )
    if found.verdict != "PASS" or not found.export_dir:
        cause = found.error or f"logits check {found.logits_check}"
        raise UserError(f"stage {stage}'s export is {found.verdict}: {cause}", "see the export step's log and report")
    missing = [name for name in ("transformers", "torch") if importlib.util.find_spec(name) is None]
    if missing:  # before a gs:// export (about 16 GB at 8B) is copied
        raise InputError(
            f"{' and '.join(missing)} not installed in this Python",
            "pip install 'transformers>=4.57' torch, or call this from the trainer environment",
        )
    source = found.export_dir
    if storage.is_remote(source):
        source = _copy_export(source, local_dir)
    return hf_loader.load(source, **from_pretrained)


def _copy_export(remote: str, local_dir: str | None) -> str:
    """Copy an export directory's files (flat, as the exporter writes them) to a local directory; its path."""
    target = storage.path(local_dir or tempfile.mkdtemp(prefix="multislice-export-"))
    target.mkdir(parents=True, exist_ok=True)
    for item in storage.path(remote).iterdir():
        with item.open("rb") as source, (target / item.name).open("wb") as copy:
            shutil.copyfileobj(source, copy, 16 << 20)
    return str(target)
