"""The compiled GKE pipeline runs the GKE implementations of the steps.

No credentials in it: tests/render/test_rbac.py.
"""

from __future__ import annotations

import yaml

from multislice import config
from pipelines.multislice_training import compile_pipeline

STEPS = ["plan", "preflight", "provision", "admit", "launch", "train", "verify_checkpoint", "export", "cleanup"]


def test_compiled_gke_pipeline_runs_the_gke_steps(tmp_path):
    path = compile_pipeline(config.read_profile("gke-v6e-16x2-seed"), str(tmp_path / "p.yaml"))
    spec = next(yaml.safe_load_all(open(path)))  # the kfp target: the PipelineSpec, then its platform config
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert "backend" not in parameters  # the profile's gke is compiled in: local cannot work remotely
    plan_inputs = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["plan"]["inputs"]["parameters"]
    assert plan_inputs["backend"]["runtimeValue"]["constant"] == "gke"  # each step acts through the plan's backend
    executors = spec["deploymentSpec"]["executors"]
    sources = "\n".join(" ".join(e["container"]["command"]) for e in executors.values())
    for step in STEPS:
        assert f"from multislice.steps import {step}" in sources, step
    cleanup = next(t for t in spec["root"]["dag"]["tasks"].values() if t["componentRef"]["name"].endswith("cleanup"))
    cluster = cleanup["inputs"]["parameters"]["cluster"]["runtimeValue"]["constant"]
    assert cluster == {"project": "your-project", "location": "us-east5", "name": "your-cluster", "access": "gke"}
    assert cleanup["inputs"]["parameters"]["namespace"] == {"componentInputParameter": "namespace"}
    for name in ("cluster_project", "cluster_location", "cluster_name", "cluster_access"):  # run parameters
        assert cleanup["inputs"]["parameters"][name] == {"componentInputParameter": name}
