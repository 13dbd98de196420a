"""Every manifest of a plan, validated, for ``multislice render`` and the golden files.

xpk's ``--dry-run`` / ``--output-manifest-file`` counterpart: the Kueue
objects a cluster needs once, and each stage's JobSet for TPU (what runs on
GKE) and for CPU (what the local backend runs). For the
``gke`` backend also the RBAC objects (:mod:`multislice.render.rbac`) and the node
pool plan: the GKE API requests provision would send to create the run's TPU
node pools (:func:`multislice.backends.gke.nodepool.node_pool_plan`), written under
``gke-api/`` so that ``kubectl apply -f DIR`` does not read it, and the reaper CronJob
(``cronjob-multislice-reaper.yaml``, :func:`multislice.backends.gke.lease.reaper_cronjob`): the
cluster-owned safety net that deletes a cancelled run's JobSets once their Lease expired.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from multislice.plan import Plan
from multislice.render import jobset, kueue, ray, rbac, schema

#: Where the node pool plan goes, relative to the output directory.
NODE_POOL_PLAN = "gke-api/node-pools.json"


def object_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject ``obj``: CRD kinds against their CRD, built-in kinds by :mod:`rbac`
    (RBAC) or :mod:`ray` (DRA ResourceClaimTemplates)."""
    if (obj.get("apiVersion"), obj.get("kind")) == (ray.CLAIM_API_VERSION, "ResourceClaimTemplate"):
        return ray.claim_template_problems(obj)
    if (obj.get("apiVersion"), obj.get("kind")) == ("batch/v1", "CronJob"):
        return schema.builtin_problems(obj) + cronjob_problems(obj)
    if (obj.get("apiVersion"), obj.get("kind")) == ("batch/v1", "Job"):
        return schema.builtin_problems(obj) + job_problems(obj)
    if (obj.get("apiVersion"), obj.get("kind")) in schema.BUILTIN_KINDS:
        return rbac.problems(obj)
    return schema.problems(obj)


def cronjob_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject a rendered ``batch/v1`` CronJob's spec; empty when valid.

    Read into the official client's ``V1CronJob`` model, whose setters refuse a missing required field
    (``schedule``, ``jobTemplate``, a container's ``name``) as the API's OpenAPI schema marks them; unknown
    fields are refused by name (the model would drop them silently).
    """
    from kubernetes import client

    found: list[str] = []
    if set(obj.get("spec", {})) - set(client.V1CronJobSpec.attribute_map.values()):
        found.append(
            f"spec: unknown fields {sorted(set(obj['spec']) - set(client.V1CronJobSpec.attribute_map.values()))}"
        )
    try:
        client.ApiClient()._ApiClient__deserialize(obj, "V1CronJob")  # the client's own model check
    except (ValueError, TypeError) as error:
        found.append(f"spec: {error}")
    return found


def job_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject a rendered ``batch/v1`` Job (the export Job); empty when valid.

    Read into the official client's ``V1Job`` model, whose setters refuse a missing required field (a container's
    ``name``, a volume's ``name``, an env var's ``name``) as the API's OpenAPI schema marks them; unknown fields of the
    Job, pod and container specs are refused by name (the model would drop them silently); every resource quantity
    must parse (``kubernetes.utils.parse_quantity``, the API's ``resource.Quantity`` grammar); limits may not be
    below requests (the API server's ``ValidateResourceRequirements``).
    """
    from kubernetes import client, utils

    found: list[str] = []
    spec = obj.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    for where, given, model in (
        ("spec", spec, client.V1JobSpec),
        ("spec.template.spec", pod, client.V1PodSpec),
        *(
            (f"spec.template.spec.containers[{i}]", c, client.V1Container)
            for i, c in enumerate(pod.get("containers", []))
        ),
    ):
        unknown = sorted(set(given) - set(model.attribute_map.values()))
        if unknown:
            found.append(f"{where}: unknown fields {unknown}")
    for i, container in enumerate(pod.get("containers", [])):
        limits = container.get("resources", {}).get("limits", {})
        requests = container.get("resources", {}).get("requests", {})
        for kind, values in (("requests", requests), ("limits", limits)):
            for name, value in values.items():
                try:
                    utils.parse_quantity(value)
                except ValueError:
                    found.append(f"spec.template.spec.containers[{i}].resources.{kind}.{name}: {value!r} is not a "
                                 "quantity")  # fmt: skip
        for name in set(limits) & set(requests):
            try:
                if utils.parse_quantity(limits[name]) < utils.parse_quantity(requests[name]):
                    found.append(f"spec.template.spec.containers[{i}].resources: {name} limit below its request")
            except ValueError:
                pass
    if pod.get("restartPolicy") not in ("Never", "OnFailure"):
        found.append("spec.template.spec.restartPolicy: a Job's pods restart Never or OnFailure")
    try:
        client.ApiClient()._ApiClient__deserialize(obj, "V1Job")  # the client's own model check
    except (ValueError, TypeError) as error:
        found.append(f"spec: {error}")
    return found


def render_all(plan: Plan, pipeline_run_id: str) -> dict[str, dict[str, Any]]:
    """File name -> object for every Kubernetes manifest of the plan, each validated.

    Kueue objects (``kueue-<kind>-<name>.yaml``), each stage's JobSet in both
    hardware variants (``jobset-<stage>.<tpu|cpu>.yaml``) and, for backend ``gke``, the
    RBAC objects (``rbac-<kind>-<name>.yaml``). A stage with ``launcher: ray`` has instead
    its RayJob for GKE (``rayjob-<stage>.tpu.yaml``), its DRANET claim templates
    (``resourceclaimtemplate-<name>.yaml``, with additional node networks) and the local
    backend's driver JobSet (``jobset-<stage>.cpu.yaml``, :func:`multislice.render.jobset.render_jobset`).
    For backend ``gke``, a stage with ``export`` also has its export Job (``job-<stage>-export.yaml``,
    :func:`multislice.backends.gke.exporter.render_job`).

    Raises:
        multislice.render.schema.ManifestInvalid: an object fails validation (a renderer bug).
    """
    out: dict[str, dict[str, Any]] = {}
    for obj in kueue.render_kueue_objects(plan):
        out[f"kueue-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"] = obj
    for stage in plan.stages:
        if stage.launcher == "ray":
            out[f"rayjob-{stage.name}.tpu.yaml"] = ray.render_rayjob(plan, stage, pipeline_run_id=pipeline_run_id)
            for obj in ray.render_claim_templates(plan, stage, pipeline_run_id=pipeline_run_id):
                out[f"resourceclaimtemplate-{obj['metadata']['name']}.yaml"] = obj
            out[f"jobset-{stage.name}.cpu.yaml"] = jobset.render_jobset(
                plan, stage, hardware="cpu", pipeline_run_id=pipeline_run_id
            )
            continue
        for hardware in ("tpu", "cpu"):
            out[f"jobset-{stage.name}.{hardware}.yaml"] = jobset.render_jobset(
                plan, stage, hardware=hardware, pipeline_run_id=pipeline_run_id
            )
    if plan.spec.backend == "gke":
        from multislice.backends.gke import lease

        for obj in rbac.render_rbac_objects(plan):
            out[f"rbac-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"] = obj
        reaper = lease.reaper_cronjob(
            plan.spec.namespace, plan.spec.images.pipeline, plan.spec.service_accounts.pipeline
        )
        out[f"cronjob-{reaper['metadata']['name']}.yaml"] = reaper
        from multislice.backends.gke import exporter

        for stage in plan.stages:
            if stage.export:
                out[f"job-{stage.name}-export.yaml"] = exporter.render_job(plan, stage, pipeline_run_id)
    for obj in out.values():
        found = object_problems(obj)
        if found:
            raise schema.ManifestInvalid(obj, found)
    return out


def render_files(plan: Plan, pipeline_run_id: str) -> dict[str, str]:
    """Relative path -> text of every file ``multislice render`` writes: :func:`render_all` as YAML, plus,
    for backend ``gke``, the node pool plan (:data:`NODE_POOL_PLAN`, JSON).

    Raises:
        multislice.render.schema.ManifestInvalid: an object fails validation.
        multislice.config.ConfigError: backend gke without a complete cluster reference.
    """
    files = {name: to_yaml(obj) for name, obj in render_all(plan, pipeline_run_id).items()}
    if plan.spec.backend == "gke":
        from multislice.backends.gke import nodepool  # the GKE client libraries, only where needed

        files[NODE_POOL_PLAN] = json.dumps(nodepool.node_pool_plan(plan), indent=2) + "\n"
    return files


def to_yaml(obj: dict[str, Any]) -> str:
    """YAML text of one object, keys in rendering order (libyaml's safe dumper when present: same text, faster)."""
    return yaml.dump(obj, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False, width=120)


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
