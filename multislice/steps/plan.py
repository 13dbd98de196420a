"""plan: validate the profile with this run's parameters and resolve it into a plan.

Runs before anything is created. The pipeline runs one plan task per stage
(each with the run's parameters and that stage's own), all before provision,
so that a bad value anywhere fails the run before any resource is asked for.
"""

from __future__ import annotations

import os
from typing import Any

from multislice import config
from multislice.config import parameters as pipeline_parameters
from multislice.plan import Plan, make_plan
from multislice.steps import is_local_path, say, write_report


def run(
    profile: dict[str, Any], parameters: dict[str, Any], stage: str | None = None, pipeline_run_id: str = ""
) -> Plan:
    """Validate ``profile`` with ``parameters`` applied (names from :mod:`multislice.config.parameters`).

    ``stage`` names the stage this plan task serves; its report goes under that stage.
    With ``unique_run_name`` true, the run name gets ``pipeline_run_id``'s first
    characters appended (:func:`multislice.config.parameters.unique_run_name`).

    On the local backend a relative ``output_dir`` is made absolute here
    (relative to this process's working directory), since every later step
    and pod must agree on it.

    Returns:
        The plan.

    Raises:
        multislice.config.ConfigError: naming every bad field and its fix.
    """
    parameters = dict(parameters)
    backend = parameters.get("backend", profile.get("backend"))
    output_dir = str(parameters.get("output_dir", profile.get("output_dir", "")))
    if backend == "local" and output_dir and is_local_path(output_dir) and not os.path.isabs(output_dir):
        parameters["output_dir"] = os.path.abspath(output_dir)
    if parameters.get("unique_run_name", profile.get("unique_run_name")) and pipeline_run_id:
        parameters["run_name"] = pipeline_parameters.unique_run_name(
            str(parameters.get("run_name", profile.get("run_name", ""))), pipeline_run_id
        )
    spec = config.load_spec(profile, parameters)
    plan = make_plan(spec)
    say(
        "plan",
        f"run {spec.run_name}: {spec.num_slices} x {spec.tpu_type} ({plan.total_chips} chips), "
        f"backend {spec.backend}, {len(plan.stages)} stages, outputs in {plan.run_dir}",
    )
    stages = [plan.stage(stage)] if stage else plan.stages
    for resolved in stages:
        say(
            "plan",
            f"stage {resolved.index + 1} {resolved.name}: {resolved.model_label}; {resolved.steps} steps, "
            f"global batch {resolved.global_batch_size:g} sequences; JobSet {resolved.jobset}",
        )
    write_report(plan, "plan", {"plan": plan.model_dump(mode="json")}, stages[0] if stage else None)
    return plan
