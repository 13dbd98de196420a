"""plan: validate the profile with this run's parameters and resolve it into a plan.

Runs before anything is created. The pipeline runs one plan task per stage
(each with the run's parameters and that stage's own), all before provision,
so that a bad value anywhere fails the run before any resource is asked for.
"""

from __future__ import annotations

import os
from typing import Any

from multislice import cancel, config, ownership
from multislice.backends import Backend, manifests
from multislice.config import data, hub
from multislice.identity import run_identity
from multislice.plan import Plan, make_plan
from multislice.release import check as release_check
from multislice.reports import PlanReport
from multislice.steps import backend_of, cancellable, say, teller, write_report


def trainer_site_packages() -> str | None:
    """The local trainer environment's site-packages (where ``site-packages:`` data globs point), or None."""
    from multislice.backends.local.environment import TrainerEnvMissing, trainer_env  # the local backend: local runs

    try:
        found = sorted(trainer_env().glob("lib/python3*/site-packages"))
    except TrainerEnvMissing:
        return None
    return str(found[0]) if found else None


def run(
    profile: dict[str, Any],
    parameters: dict[str, Any],
    stage: str | None = None,
    pipeline_run_id: str = "",
    release: dict[str, str] | None = None,
    *,
    hold: bool = False,
    backend: Backend | None = None,
) -> Plan:
    """Validate ``profile`` with ``parameters`` applied (names from :mod:`multislice.config.parameters`).

    ``stage`` names the stage this plan task serves; its report goes under that stage.
    The run's name and directory come from :func:`multislice.identity.run_identity`:
    with ``unique_run_name`` true the run name gets ``pipeline_run_id``'s first
    characters appended, and a relative ``output_dir`` is made absolute here
    (every later step and pod process must agree on it).

    ``release``: :func:`multislice.release.current` of the machine that compiled the pipeline;
    checked against this image's first (None or ``{}``: no check, e.g. ``multislice run``).

    ``hold`` (the pipeline's plan task) or ``backend`` (tests): on GKE, with ``pipeline_run_id``, take the
    run's hold on the cluster (the run Lease, :meth:`multislice.backends.base.Backend.holding_run`) once the
    plan is valid, so a run terminated from here on is ended by the reaper if no exit handler runs.

    Returns:
        The plan.

    The run directory is then taken for ``pipeline_run_id`` (:func:`multislice.ownership.join`) before
    anything is written there.

    Raises:
        multislice.ownership.RunDirOwned: another live run owns the run directory (nothing was written).
        multislice.release.ReleaseMismatch: the pipeline YAML and this image are different releases.
        multislice.config.ConfigError: naming every bad field and its fix, the stages' data included (a
            missing path, an empty glob, a missing split, an unreadable Parquet file:
            :func:`multislice.config.data.data_issues`), and every export that could not run (a model or
            tokenizer the exporter cannot export, a destination this user cannot write, a Hub repository with no
            token: :func:`multislice.config.checks.export_issues` and ``export_environment_issues``).
        multislice.render.schema.ManifestInvalid: a rendered manifest (JobSet, Kueue, RBAC) would be refused
            by the API server; checked here, before preflight and provision.
    """
    with cancellable("plan") as removal:
        release_check(release)
        parameters = dict(parameters)
        unique = parameters.get("unique_run_name", profile.get("unique_run_name"))
        identity = run_identity(
            str(parameters.get("run_name", profile.get("run_name", ""))),
            str(parameters.get("output_dir", profile.get("output_dir", ""))),
            unique_run_name_from=pipeline_run_id if unique else "",
        )
        parameters.update(run_name=identity.run_name, output_dir=identity.output_dir)
        if unique and pipeline_run_id:
            # The run name is final now (suffix appended): validate it as it is, not with another suffix.
            parameters["unique_run_name"] = False
        spec = config.load_spec(profile, parameters)
        plan = make_plan(spec)
        if pipeline_run_id:  # before this pipeline run writes anything: refused if another live run owns the directory
            ownership.join(plan.run_dir, pipeline_run_id)
        if pipeline_run_id and spec.backend == "gke" and (hold or backend is not None):
            removal.hold_for = (plan, pipeline_run_id, "plan", teller("plan"))
            removal.backend = backend_of(plan, backend, "plan")
        # The stages' data (paths, globs, splits, Parquet files) read now, before anything is created.
        issues = data.data_issues(
            spec, trainer_site_packages() if spec.backend == "local" else None, stage_hub_tokens(spec)
        )
        # Each export's tokenizer files, destination and (locally) Hub token, before anything is created.
        issues += config.export_environment_issues(spec, {s.name: s.export_dir for s in plan.stages if s.export_dir})
        if issues:
            raise config.ConfigError(issues)
        # Every manifest the run will submit, validated against its CRD (or API fields) now, before
        # preflight and provision ask for anything.
        manifests.render_all(plan, pipeline_run_id or "manual")
        say(
            "plan",
            f"run {spec.run_name}: {spec.num_slices} x {spec.tpu_type} ({plan.total_chips} chips), "
            f"backend {spec.backend}, {len(plan.stages)} stages, outputs in {plan.run_dir}",
        )
        for followed in config.followed_checkpoint_periods(profile, parameters):
            say("plan", followed.describe())
        stages = [plan.stage(stage)] if stage else plan.stages
        for resolved in stages:
            say(
                "plan",
                f"stage {resolved.index + 1} {resolved.name}: {resolved.model_label}; {resolved.steps} steps, "
                f"global batch {resolved.global_batch_size:g} sequences; JobSet {resolved.workload}",
            )
        cancel.point("plan:report")
        write_report(plan, PlanReport(plan=plan), stages[0] if stage else None)
        return plan


def stage_hub_tokens(spec: config.RunSpec) -> dict[str, str]:
    """Stage name -> the Hugging Face token the plan lists the stage's ``hf://`` globs with: the one its training
    pods get, so a private or gated dataset the pods can read is not refused at plan.

    For each ``gke`` stage whose data has an ``hf://`` glob: with ``data.hf_token_kubernetes_secret``, the variable
    the compiled KFP pipeline fills from that Secret (:func:`multislice.config.hub.plan_token_env`,
    :meth:`multislice.delivery.targets.KubernetesConfig.mount_hub_tokens`); with ``data.hf_token_secret``, the
    Secret Manager version read now with the step's Google credentials (the run's service account on Vertex AI, the
    pipeline's Workload Identity on KFP: both need ``roles/secretmanager.secretAccessor`` on it, as the trainer's
    does), as the trainer pods read it (:func:`multislice.trainer.hub_token.read_secret`). A stage left out (no token
    found, a local run) lists with ``$HF_TOKEN``. The tokens are never printed or written.

    Raises:
        multislice.config.ConfigError: a ``data.hf_token_secret`` that cannot be read, naming the field and the fix.
    """
    tokens: dict[str, str] = {}
    if spec.backend != "gke":
        return tokens
    for index, stage in enumerate(spec.stages):
        globs = [str(getattr(stage.data, name, "") or "") for name in ("train_files", "eval_files")]
        if not any(data.HF_PREFIX in text for text in globs):
            continue
        secret = getattr(stage.data, "hf_token_kubernetes_secret", "")
        version = getattr(stage.data, "hf_token_secret", "")
        if secret and os.environ.get(hub.plan_token_env(secret)):
            tokens[stage.name] = os.environ[hub.plan_token_env(secret)]
        elif version:
            from multislice.trainer import hub_token  # google-auth: only for a stage whose token is in Secret Manager

            try:
                tokens[stage.name] = hub_token.read_secret(version)
            except hub_token.TokenUnavailable as error:
                raise config.ConfigError([(
                    f"stages[{index}] ({stage.name}).data.hf_token_secret",
                    f"{error}: the plan lists the stage's hf:// files with the token its pods get; grant the "
                    "pipeline's Google service account roles/secretmanager.secretAccessor on the secret",
                )]) from None  # fmt: skip
    return tokens
