"""Render a one-pod Job (batch/v1) of the trainer image: the checkpoint verifier, the Hugging Face export and
preflight's AOT compiles on GKE."""

from __future__ import annotations

from typing import Any

from multislice import names
from multislice.plan import Plan, StagePlan
from multislice.render.jobset import run_labels, unbuffered_env


def render_trainer_job(
    plan: Plan,
    name: str,
    command: list[str],
    pipeline_run_id: str,
    *,
    stage: StagePlan | None = None,
    env: dict[str, str] | None = None,
    resources: dict[str, Any] | None = None,
    node_selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A one-pod Job (batch/v1) of the trainer image on CPU: no retries, the run's labels.

    It runs as the trainer's ServiceAccount (:mod:`multislice.render.rbac`), whose
    Workload Identity reads and writes the run's ``gs://`` paths; JAX is told
    to use the CPU (``JAX_PLATFORMS=cpu``) and Python not to buffer its output (``PYTHONUNBUFFERED=1``).
    ``node_selector`` (pod ``spec.nodeSelector``) picks its nodes.
    """
    labels = run_labels(plan, pipeline_run_id, stage)
    container: dict[str, Any] = {
        "name": names.TRAINER_CONTAINER,
        "image": plan.spec.images.trainer,
        "command": command,
        "env": [
            *({"name": k, "value": v} for k, v in {"JAX_PLATFORMS": "cpu", **(env or {})}.items()),
            unbuffered_env(),
        ],
    }
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "serviceAccountName": plan.spec.service_accounts.trainer,
        "restartPolicy": "Never",
        "containers": [container],
    }
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": plan.spec.namespace, "labels": labels},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": pod_spec,
            },
        },
    }
