"""Compile targets through the CLI: kfp carries the kfp-kubernetes platform config, vertex is one document."""

import re

import pytest
from kfp import components

from multislice import cli, config, timings
from multislice.delivery import targets


def test_kfp_target_with_node_selector_and_timeouts(tmp_path):
    output = tmp_path / "kfp.yaml"
    assert cli.main(["compile", "--profile", "local", "--target", "kfp", "--output", str(output),
                     "--node-selector", "cloud.google.com/gke-nodepool=pipelines-cpu"]) == 0  # fmt: skip
    spec, platform = targets.documents(output)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == set(spec["deploymentSpec"]["executors"])  # every task, admit included
    for name, executor in executors.items():
        assert executor["nodeSelector"] == {"labels": {"cloud.google.com/gke-nodepool": "pipelines-cpu"}}, name
    assert executors["exec-admit"]["activeDeadlineSeconds"]  # every step has a deadline, admit included
    assert components.load_component_from_file(str(output)).name == "multislice-training"


def longest_waits(waits: timings.Timings) -> dict[str, float]:
    """Each step's longest wait, read off the waits the backends take from these fields."""
    api = waits.api_deadline
    return {
        "plan": 0.0,
        "prepare_data": waits.prepare_data_timeout,  # tokenizing a stage's text
        "preflight": waits.compile_timeout + waits.alternative_budget,  # one stage's compile, then the search
        "provision": waits.provision_timeout,
        "admit": waits.admit_timeout,
        "launch": max(waits.launch_timeout, waits.unschedulable_grace),
        "train": max(waits.train_timeout, waits.readmit_timeout),
        "verify_checkpoint": waits.verify_timeout,
        "export": waits.verify_timeout,  # the exporter runs under the verifier's timeout
        "cleanup": waits.delete_timeout + 4 * api,  # two lists and their deletes, each retried up to api
    }


@pytest.mark.parametrize("overrides", [[], ["timeouts.train=1000000", "timeouts.launch=7200"]], ids=["defaults", "set"])
@pytest.mark.parametrize("profile", sorted(p.stem for p in config.PROFILES_DIR.glob("*.yaml")))
def test_no_pod_deadline_is_shorter_than_its_steps_longest_wait(tmp_path, profile, overrides):
    output = tmp_path / "kfp.yaml"
    assert cli.main(["compile", "--profile", profile, "--output", str(output), *[f"--set={o}" for o in overrides]]) == 0
    _, platform = targets.documents(output)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    spec = config.load_profile(profile, config.parse_set_arguments(overrides))
    checked = set()
    for name, executor in executors.items():
        step = re.sub(r"-\d+$", "", name.removeprefix("exec-")).replace("-", "_")
        deadline = int(executor["activeDeadlineSeconds"])
        for backend in timings.DEFAULTS:  # backend is a run parameter: the deadline must cover either
            waits = timings.timings_for(spec, backend)
            margin = waits.api_deadline + 60  # one more API call, and the pod's own start
            assert deadline > longest_waits(waits)[step] + margin, (name, backend)
        checked.add(step)
    exported = any(stage.export for stage in spec.stages)  # export is a task only where a stage exports
    assert checked == set(timings.STEPS) - ({"export"} if not exported else set())
    if overrides:
        assert int(executors["exec-train"]["activeDeadlineSeconds"]) > 1_000_000


def test_vertex_target_is_one_document(tmp_path):
    output = tmp_path / "vertex.yaml"
    assert cli.main(["compile", "--profile", "local", "--target", "vertex", "--output", str(output)]) == 0
    [spec] = targets.documents(output)
    assert spec["pipelineInfo"]["name"] == "multislice-training"
    assert components.load_component_from_file(str(output)).component_spec.inputs["notify_webhook_secret"].default == ""
