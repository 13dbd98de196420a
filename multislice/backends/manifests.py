"""Every manifest of a plan, validated, for ``multislice render``, the plan step and the golden files.

xpk's ``--dry-run`` / ``--output-manifest-file`` counterpart: the Kueue
objects a cluster needs once, and each stage's JobSet for TPU (what runs on
GKE) and for CPU (what the local backend runs). For the
``gke`` backend also the RBAC objects (:mod:`multislice.render.rbac`) and the node
pool plan: the GKE API requests provision would send to create the run's TPU
node pools (:func:`multislice.backends.gke.nodepool.node_pool_plan`), written under
``gke-api/`` so that ``kubectl apply -f DIR`` does not read it, and the reaper CronJob
(``cronjob-multislice-reaper.yaml``, :func:`multislice.backends.gke.lease.reaper_cronjob`): the
cluster-owned safety net that deletes a cancelled run's JobSets once their Lease expired. With DRANET under
Kueue, also the part of Kueue's own Configuration the run needs (:func:`multislice.render.kueue.kueue_configuration`),
under ``kueue-config/``: a file a cluster admin merges into Kueue's ConfigMap, not an object to apply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from multislice.plan import Plan
from multislice.render import in_place, kueue, launchers, rbac, schema
from multislice.render.manifests import object_problems, to_yaml

#: Where the node pool plan goes, relative to the output directory.
NODE_POOL_PLAN = "gke-api/node-pools.json"
#: Where the Kueue Configuration fragment goes, relative to the output directory.
KUEUE_CONFIGURATION = "kueue-config/controller_manager_config.yaml"


def kueue_configuration_text(plan: Plan) -> str | None:
    """The Kueue Configuration fragment's file text (:func:`multislice.render.kueue.kueue_configuration`), with a
    header saying where it goes; None when the plan needs nothing in Kueue's Configuration."""
    fragment = kueue.kueue_configuration(plan)
    if fragment is None:
        return None
    header = (
        f"# Merge into Kueue's Configuration: ConfigMap {kueue.KUEUE_CONFIG_NAMESPACE}/{kueue.KUEUE_CONFIG_MAP}, key\n"
        f"# {kueue.KUEUE_CONFIG_KEY} (add the entry to resources.deviceClassMappings), then restart Kueue:\n"
        f"#   kubectl -n {kueue.KUEUE_CONFIG_NAMESPACE} rollout restart deployment kueue-controller-manager\n"
        "# Without it Kueue marks the RayJob's Workload inadmissible (DeviceClass ... is not mapped in DRA\n"
        "# configuration); provision checks it. See docs/gke-setup.md.\n"
    )
    return header + to_yaml(fragment)


def render_all(plan: Plan, pipeline_run_id: str) -> dict[str, dict[str, Any]]:
    """File name -> object for every Kubernetes manifest of the plan, each validated.

    Kueue objects (``kueue-<kind>-<name>.yaml``), each stage's JobSet in both
    hardware variants (``jobset-<stage>.<tpu|cpu>.yaml``) and, for backend ``gke``, the
    RBAC objects (``rbac-<kind>-<name>.yaml``). Each stage's launcher (:func:`multislice.render.launchers.kind_of`)
    renders it: a stage with ``launcher: ray`` has instead its RayJob for GKE (``rayjob-<stage>.tpu.yaml``), its
    DRANET claim templates (``resourceclaimtemplate-<name>.yaml``, with additional node networks) and the local
    backend's driver JobSet (``jobset-<stage>.cpu.yaml``).
    For backend ``gke``, a stage with ``export`` also has its export Job (``job-<stage>-export.yaml``,
    :func:`multislice.backends.gke.exporter.render_job`), and a stage of ``text`` data the Job of prepare_data's
    shard workers (``job-<stage>-data.yaml``, a placeholder: :func:`multislice.backends.gke.data_workers.
    placeholder_job`).

    Raises:
        multislice.render.schema.ManifestInvalid: an object fails validation (a renderer bug).
    """
    workloads: dict[str, dict[str, Any]] = {}
    for stage in plan.stages:
        launcher = launchers.kind_of(stage)
        tpu = launcher.render(plan, stage, "tpu", pipeline_run_id)
        workloads[f"{tpu['kind'].lower()}-{stage.name}.tpu.yaml"] = tpu
        for obj in launcher.companions(plan, stage, pipeline_run_id):
            workloads[f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"] = obj
        workloads[f"jobset-{stage.name}.cpu.yaml"] = launcher.render(plan, stage, "cpu", pipeline_run_id)
    for obj in workloads.values():  # first: the Kueue quota is computed from these workloads' pod sets
        found = object_problems(obj)
        if found:
            raise schema.ManifestInvalid(obj, found)
    out: dict[str, dict[str, Any]] = {}
    for obj in kueue.render_kueue_objects(plan):
        out[f"kueue-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"] = obj
    out.update(workloads)
    if plan.spec.backend == "gke":
        from multislice.backends.gke import data_workers, exporter, lease  # the kubernetes client: gke only

        for obj in rbac.render_rbac_objects(plan):
            out[f"rbac-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"] = obj
        accounts = plan.spec.service_accounts
        reaper = lease.reaper_cronjob(
            plan.spec.namespace, plan.spec.images.pipeline, accounts.pipeline, plan.spec.cluster,
            accounts.pipeline_namespace,
        )  # fmt: skip
        out[f"cronjob-{reaper['metadata']['name']}.yaml"] = reaper
        for stage in plan.stages:
            if stage.export:
                out[f"job-{stage.name}-export.yaml"] = exporter.render_job(plan, stage, pipeline_run_id)
            if (workers := data_workers.placeholder_job(plan, stage, pipeline_run_id)) is not None:
                out[f"job-{stage.name}-data.yaml"] = workers
    for name, obj in out.items():
        found = [] if name in workloads else object_problems(obj)
        if found:
            raise schema.ManifestInvalid(obj, found)
    return out


def render_files(plan: Plan, pipeline_run_id: str) -> dict[str, str]:
    """Relative path -> text of every file ``multislice render`` writes: :func:`render_all` as YAML, plus,
    for backend ``gke``, the node pool plan (:data:`NODE_POOL_PLAN`, JSON) and, with DRANET under Kueue, the Kueue
    Configuration fragment (:data:`KUEUE_CONFIGURATION`).

    Raises:
        multislice.render.schema.ManifestInvalid: an object fails validation.
        multislice.config.ConfigError: backend gke without a complete cluster reference.
    """
    files = {name: to_yaml(obj) for name, obj in render_all(plan, pipeline_run_id).items()}
    if plan.spec.backend == "gke":
        from multislice.backends.gke import nodepool  # the GKE client libraries: only for a gke plan

        files[NODE_POOL_PLAN] = json.dumps(nodepool.node_pool_plan(plan), indent=2) + "\n"
        configuration = kueue_configuration_text(plan)
        if configuration is not None:
            files[KUEUE_CONFIGURATION] = configuration
    return files


def write_manifests(plan: Plan, directory: Path, pipeline_run_id: str) -> list[Path]:
    """Write :func:`render_files` into ``directory``; returns the paths.

    Everything is rendered and validated first: on an invalid manifest nothing is written and
    ``directory`` is not created.
    """
    files = render_files(plan, pipeline_run_id)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        paths.append(path)
    return paths


def in_place_note(plan: Plan) -> str:
    """How the rendered TPU JobSets restart, and what provision does about it (:mod:`multislice.render.in_place`,
    :mod:`multislice.backends.gke.in_place`)."""
    if in_place.requested(plan, "tpu") == in_place.RECREATE:
        return "TPU JobSets restart with restartStrategy Recreate (restart_strategy: recreate): every pod recreated"
    fallback = (
        "provision checks the cluster with dry runs and falls back to Recreate, saying why, where JobSet's "
        "InPlaceRestart gate or Kubernetes 1.35's RestartAllContainers gates are off"
        if plan.spec.restart_strategy == "auto"
        else "provision refuses a cluster without JobSet's InPlaceRestart gate or Kubernetes 1.35's "
        "RestartAllContainers gates (restart_strategy: in_place)"
    )
    return (
        "TPU JobSets restart with restartStrategy InPlaceRestart (pods stay on their nodes, containers restart; "
        f"agent image {plan.spec.images.in_place_restart_agent}); {fallback}; see docs/gke-setup.md"
    )
