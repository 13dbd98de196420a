"""Every manifest of a plan, validated, for ``multislice render`` and the golden files.

xpk's ``--dry-run`` / ``--output-manifest-file`` counterpart: the Kueue
objects a cluster needs once, and each stage's JobSet in the TPU flavour (what
runs on GKE) and the CPU flavour (what the local backend runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from multislice import jobset, kueue, schema
from multislice.plan import Plan


def render_all(plan: Plan, pipeline_run_id: str) -> dict[str, dict[str, Any]]:
    """File name -> object for every manifest of the plan, each validated against its CRD.

    Raises:
        multislice.schema.ManifestInvalid: an object fails validation (a renderer bug).
    """
    out: dict[str, dict[str, Any]] = {}
    for obj in kueue.render_kueue_objects(plan):
        out[f"kueue-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"] = obj
    for stage in plan.stages:
        for flavour in ("tpu", "cpu"):
            out[f"jobset-{stage.name}.{flavour}.yaml"] = jobset.render_jobset(
                plan, stage, flavour=flavour, pipeline_run_id=pipeline_run_id
            )
    for obj in out.values():
        schema.validate(obj)
    return out


def to_yaml(obj: dict[str, Any]) -> str:
    """YAML text of one object, keys in rendering order."""
    return yaml.safe_dump(obj, sort_keys=False, width=120)


def write_manifests(plan: Plan, directory: Path, pipeline_run_id: str) -> list[Path]:
    """Write :func:`render_all`'s objects as YAML files into ``directory``; returns the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, obj in render_all(plan, pipeline_run_id).items():
        path = directory / name
        path.write_text(to_yaml(obj), encoding="utf-8")
        paths.append(path)
    return paths
