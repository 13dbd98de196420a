"""The compiled GKE pipeline: no credentials in it, and every step component calls the step that dispatches to GKE."""

from __future__ import annotations

import re

import yaml

from multislice import config
from pipelines.multislice_training import compile_pipeline

#: What would betray a credential in compiled YAML: OAuth tokens, bearer headers, keys, certificates, kubeconfigs.
CREDENTIAL_PATTERNS = [r"ya29\.", r"Bearer ", r"BEGIN [A-Z ]*(CERTIFICATE|PRIVATE KEY)", r"private_key",
                       r"client_secret", r"client-key-data", r"\btoken:", r"api_key", r"password"]  # fmt: skip
STEPS = ["plan", "provision", "admit", "launch", "train", "verify_checkpoint", "cleanup"]


def test_compiled_gke_pipeline_holds_no_credentials_and_runs_the_gke_steps(tmp_path):
    path = compile_pipeline(config.read_profile("gke-v6e-16x2"), str(tmp_path / "gke.yaml"))
    text = open(path, encoding="utf-8").read()
    for pattern in CREDENTIAL_PATTERNS:
        assert not re.search(pattern, text), pattern
    spec = yaml.safe_load(text)
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    assert parameters["backend"]["defaultValue"] == "gke"
    executors = spec["deploymentSpec"]["executors"]
    sources = "\n".join(" ".join(e["container"]["command"]) for e in executors.values())
    for step in STEPS:
        assert f"from multislice.steps import {step}" in sources, step
    cleanup = next(t for t in spec["root"]["dag"]["tasks"].values() if t["componentRef"]["name"].endswith("cleanup"))
    cluster = cleanup["inputs"]["parameters"]["cluster"]["runtimeValue"]["constant"]
    assert cluster == {"project": "YOUR_PROJECT", "location": "us-east5", "name": "YOUR_CLUSTER", "access": "gke"}
