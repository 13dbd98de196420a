"""The verification and Hugging Face export of a stage with ``export``: one Kubernetes Job of the trainer image on a
CPU node pool, which the verify step starts and reads first and the export step adopts and reads to its end.

The Job runs ``python -m multislice.trainer.verify_export`` (:func:`multislice.trainer.verify_export.command`: the
exporter's command line, the same one the local backend runs) on the stage's final checkpoint in Cloud Storage: the
checkpoint verifier first, in the same process, and then, only on a PASS, the exporter, which converts the checkpoint
into a local scratch directory, checks the logits there, and copies the export to the stage's ``gs://`` export
directory (and, with ``stages[].export_hub_repo``, publishes it to the Hugging Face Hub). One process pays the
interpreter's start and the imports of JAX, Orbax and MaxText once, where a verifier Job and an export Job paid
them (and a pod's scheduling and image start) twice.

The verify step (:func:`run_verification`) creates (or adopts) the Job and waits until the pod's log has the
verifier's report (the ``multislice-verification:`` line, :func:`multislice.trainer.verify_export.reports_in`),
then returns with the Job still exporting: the next stage is admitted while the export runs, as when the export
was a Job of its own. The export step (:func:`run`) renders the same Job, so it adopts it by its spec hash
(:func:`multislice.backends.gke.jobs.run_job`), waits for its end and reads the export's report from the log's
last document, or, when the log lost it, from the copy the exporter writes to ``<stage_dir>/export/report.json``.
A FAIL or ERROR verdict ends the Job before any export (the export step, after the failed verify step, never runs).

Where it runs, and why not on the stage's TPU slice: the export is CPU work (the conversion, and the logits
check, which compares float32 CPU forward passes of MaxText and ``transformers``). The stage's TPU JobSet has
completed and Kueue has given its quota to the next stage when the export starts; holding a slice for it would
keep 16+ TPU chips idle and delay that stage. So the Job goes to the nodes ``exporter.node_selector`` names (a
CPU node pool: docs/gke-setup.md), asks for the memory :func:`multislice.exporting.sizing` gives from the model
(memory request = limit, so the scheduler places it only where it fits and it is not the first pod evicted), and
for scratch space: an ``emptyDir`` of the export's size, mounted at :data:`SCRATCH`, with ``TMPDIR`` and
``HF_HOME`` there, and an ``ephemeral-storage`` request of the same size.

The Hub token (only with ``export_hub_repo``): from a Kubernetes Secret by reference (``env.valueFrom.secretKeyRef``,
``exporter.hub_token_kubernetes_secret``, key ``token``: the kubelet reads it, the pipeline's ServiceAccount needs
no access to Secrets), or from Secret Manager (``exporter.hub_token_secret``), read inside the pod by
:mod:`multislice.trainer.hub_token` with the trainer's Google service account before it starts the exporter.
Never in the Job's arguments or the compiled pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from multislice import exporting, memory, reports, storage
from multislice.backends.gke import verifier
from multislice.backends.gke.client import Kube
from multislice.errors import RunFailed
from multislice.plan import Plan, StagePlan
from multislice.render.trainer_job import render_trainer_job
from multislice.trainer import hub_token, verify, verify_export

#: Where the scratch volume is mounted in the export pod (``TMPDIR``, ``HF_HOME``).
SCRATCH = "/scratch"
#: The scratch volume's name.
SCRATCH_VOLUME = "export-scratch"


class ExporterJobFailed(RunFailed):
    """The verify-and-export Job did not produce a report; the message has its state, events and log tail."""


def job_name(stage: StagePlan) -> str:
    """The stage's verifier Job's name, ``<jobset>-verify`` (:func:`.verifier.job_name`): the one Job verifies and
    exports."""
    return verifier.job_name(stage)


def weight_shards(stage: StagePlan) -> int:
    """How many ways the stage's training shards each weight (:func:`multislice.memory.weight_shards`): each
    storage chunk of a stacked weight in its checkpoint is one such shard."""
    return memory.weight_shards(stage.ici, stage.dcn)


def _sizing(plan: Plan, stage: StagePlan) -> exporting.ExportSizing:
    spec_stage = next(s for s in plan.spec.stages if s.name == stage.name)
    dtype = stage.export_dtype or exporting.default_dtype(spec_stage)
    return exporting.sizing(spec_stage, dtype, weight_shards(stage))


def export_seconds(plan: Plan, stage: StagePlan) -> float:
    """The export's own run time to allow after the verifier's, seconds: from the model's size
    (:func:`multislice.exporting.sizing`); 0 for a stage without an export."""
    return _sizing(plan, stage).seconds if stage.export else 0.0


def resources(plan: Plan, stage: StagePlan) -> dict[str, Any]:
    """The export pod's requests and limits: memory (request = limit) and scratch (``ephemeral-storage`` request)
    from the model (:func:`multislice.exporting.sizing`), ``exporter.cpu`` CPUs."""
    size = _sizing(plan, stage)
    memory, scratch = size.quantity(size.memory_bytes), size.quantity(size.scratch_bytes)
    return {
        "requests": {"cpu": str(plan.spec.exporter.cpu), "memory": memory, "ephemeral-storage": scratch},
        # No ephemeral-storage limit: the emptyDir's sizeLimit bounds the scratch, and the container's logs and
        # writable layer, which the limit would count too, would evict the pod at the scratch's own size.
        "limits": {"memory": memory},
    }


def render_job(
    plan: Plan, stage: StagePlan, pipeline_run_id: str, card: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The verify-and-export Job (batch/v1): one pod, no retries, the trainer image, CPU only, a scratch ``emptyDir``.

    ``card``: the model card's facts (:func:`multislice.reports.model_card`); None: the run and stage only (what
    ``multislice render`` writes, before any training).

    Raises:
        ValueError: the stage has no export.
    """
    if not stage.export or not stage.export_dir:
        raise ValueError(f"stage {stage.name} has no export")
    argv = verify_export.command(
        stage.checkpoint_dir, stage.final_step, stage.export_dir, list(stage.maxtext_args),
        dtype=stage.export_dtype, hub_repo=stage.export_hub_repo, report=stage.export_report,
        card=card if card is not None else {"run": plan.spec.run_name, "stage": stage.name},
        export_format=stage.export,
    )  # fmt: skip
    exporter = plan.spec.exporter
    if stage.export_hub_repo and exporter.hub_token_secret:
        argv = hub_token.command(exporter.hub_token_secret, argv)
    limits = resources(plan, stage)
    job = render_trainer_job(
        plan, job_name(stage), argv, pipeline_run_id, stage=stage,
        env={"TMPDIR": SCRATCH, "HF_HOME": f"{SCRATCH}/huggingface"},
        resources=limits, node_selector=exporter.node_selector,
    )  # fmt: skip
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    if stage.export_hub_repo and not exporter.hub_token_secret and exporter.hub_token_kubernetes_secret:
        container["env"].append(
            {
                "name": hub_token.ENV,
                "valueFrom": {
                    "secretKeyRef": {"name": exporter.hub_token_kubernetes_secret, "key": hub_token.SECRET_KEY}
                },
            }
        )
    container["volumeMounts"] = [{"name": SCRATCH_VOLUME, "mountPath": SCRATCH}]
    pod["volumes"] = [
        {"name": SCRATCH_VOLUME, "emptyDir": {"sizeLimit": limits["requests"]["ephemeral-storage"]}}
    ]  # fmt: skip
    return job


def _stored_report(stage: StagePlan) -> dict[str, Any] | None:
    """The exporter's copy of its report (``stage.export_report``), or None when there is none."""
    text = storage.read_text(stage.export_report) if stage.export_report else None
    return verify.parse_report(text) if text else None


def _render(plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any]:
    """The Job both steps render (the same spec, so the export step adopts the verify step's): with the model card
    from the stage's train report (:func:`multislice.reports.model_card`)."""
    return render_job(plan, stage, pipeline_run_id, reports.model_card(plan, stage))


def run_verification(
    kube: Kube,
    plan: Plan,
    stage: StagePlan,
    pipeline_run_id: str,
    *,
    timeout: float,
    on_progress: Callable[[str], None],
) -> dict[str, Any]:
    """Create (or adopt) the stage's verify-and-export Job and return the verifier's report as soon as its log has
    it; the Job goes on to export on PASS (and ends on FAIL or ERROR).

    Raises:
        ExporterJobFailed: the Job ended without a verification report (the message quotes the pod's state, events
            and log tail).
        TimeoutError: no verification report within ``timeout`` seconds (the Job was deleted).
        multislice.backends.gke.jobs.JobUnschedulable: no node fits its requests.
        multislice.backends.gke.jobset.JobSetConflict: a Job of that name with another spec exists.
    """
    return verifier.run_report_job(
        kube, _render(plan, stage, pipeline_run_id), timeout=timeout, on_progress=on_progress,
        what="verify-and-export Job", failure=ExporterJobFailed,
        fix="read the events above; check the trainer image, that its ServiceAccount may read the checkpoints, and "
        "that the node gave the pod the memory it asked for",
        parse=lambda log: verify_export.reports_in(log)[0], early=True,
    )  # fmt: skip


def run(
    kube: Kube,
    plan: Plan,
    stage: StagePlan,
    pipeline_run_id: str,
    *,
    timeout: float,
    on_progress: Callable[[str], None],
) -> dict[str, Any]:
    """Adopt (or create, when the verify step's is gone) the stage's verify-and-export Job, wait for it to finish
    and return the export's report.

    The report is the export's in the last document of the pod's log; when the log has none (rotated away) and
    the Job completed (the exporter exited 0, having written it), its copy at ``stage.export_report``.

    Raises:
        ExporterJobFailed: no report (the message quotes the pod's state, events and log tail).
        TimeoutError: not finished within ``timeout`` seconds (the Job was deleted).
        multislice.backends.gke.jobs.JobUnschedulable: no node fits its requests.
        multislice.backends.gke.jobset.JobSetConflict: a Job of that name with another spec exists.
    """
    return verifier.run_report_job(
        kube, _render(plan, stage, pipeline_run_id), timeout=timeout,
        on_progress=on_progress, what="verify-and-export Job", failure=ExporterJobFailed,
        fix="read the events above; check the trainer image, that its ServiceAccount may read the checkpoints and "
        f"write {stage.export_dir}, and that the node gave the pod the memory it asked for",
        stored=lambda: _stored_report(stage), parse=lambda log: verify_export.reports_in(log)[1],
    )  # fmt: skip
