"""The compiled pipeline: loads back with kfp, has the documented parameters and graph, matches goldens."""

import pytest
import yaml
from kfp import components

from multislice import cli, config
from multislice.config import parameters
from pipelines.multislice_training import compile_pipeline
from tests.golden import GOLDEN_DIR, PIPELINE_GOLDENS, PROFILES, compiled_pipeline

RUN_PARAMETERS = {
    "run_name": "String", "tpu_type": "String", "machine_type": "String", "num_slices": "Integer",
    "output_dir": "String", "trainer_image": "String", "namespace": "String", "queue": "String",
    "priority": "String", "max_restarts": "Integer", "launcher": "String", "skip_preflight": "Boolean",
    "unique_run_name": "Boolean",
    "notify_webhook_secret": "String", "cluster_project": "String", "cluster_location": "String",
    "cluster_name": "String", "cluster_access": "String", "zone": "String", "pipeline_service_account": "String",
    "trainer_service_account": "String",
}  # fmt: skip


@pytest.fixture(scope="module", params=PROFILES)
def compiled(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("compiled") / f"{request.param}.yaml"
    compile_pipeline(config.read_profile(request.param), str(path))
    return request.param, path


def test_compiled_pipeline_loads_back_with_its_parameters(compiled):
    profile, path = compiled
    spec = config.load_profile(profile)
    loaded = components.load_component_from_file(str(path))
    inputs = loaded.component_spec.inputs
    types = {name: value.type for name, value in inputs.items()}
    assert {k: types[k] for k in RUN_PARAMETERS} == RUN_PARAMETERS
    for n in range(1, len(spec.stages) + 1):
        assert (types[f"stage{n}_steps"], types[f"stage{n}_per_device_batch_size"]) == ("Integer", "Float")
    assert len(types) == len(RUN_PARAMETERS) + 2 * len(spec.stages)
    assert inputs["run_name"].default == spec.run_name
    assert inputs["tpu_type"].default == spec.tpu_type
    assert int(inputs["num_slices"].default) == spec.num_slices
    assert int(inputs["stage2_steps"].default) == spec.stages[1].steps
    assert loaded.required_inputs == ["output_dir"]  # a remote pipeline asks for the bucket: no placeholder
    assert "backend" not in inputs  # backend=local cannot work remotely: not offered
    # Every parameter has its run-form description, from the parameter table.
    ir = next(yaml.safe_load_all(path.read_text()))["root"]["inputDefinitions"]["parameters"]
    described = {name: value.get("description") for name, value in ir.items()}
    for parameter in parameters.RUN_PARAMETERS:
        if parameter.name != "backend":
            assert described[parameter.name] == parameter.description.rstrip(".") + ".", parameter.name
    assert described["stage2_steps"] == f"Stage 2 ({spec.stages[1].name}): Training steps."


def test_graph_order_exit_handler_and_no_caching(compiled):
    _, path = compiled
    spec = next(yaml.safe_load_all(path.read_text()))
    root = spec["root"]["dag"]["tasks"]
    assert root["cleanup"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    assert root["cleanup"]["inputs"]["parameters"]["pipeline_run_id"]["runtimeValue"]["constant"] == (
        "{{$.pipeline_job_uuid}}"
    )
    tasks = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    # every stage planned, then AOT-checked against its topology's HBM, before anything is provisioned
    assert set(tasks["provision"]["dependentTasks"]) == {"plan", "preflight", "preflight-2"}
    # each stage's data prepared (one after the other: they may share a shard directory) before its preflight
    assert tasks["prepare-data"]["dependentTasks"] == ["plan"]
    assert set(tasks["prepare-data-2"]["dependentTasks"]) == {"plan-2", "prepare-data"}
    assert set(tasks["preflight"]["dependentTasks"]) == {"plan", "prepare-data"}
    assert set(tasks["preflight-2"]["dependentTasks"]) == {"plan-2", "prepare-data-2"}
    # train consumes its stage's Dataset artifact (lineage: data -> train)
    dataset = tasks["train"]["inputs"]["artifacts"]["dataset"]["taskOutputArtifact"]
    assert dataset == {"outputArtifactKey": "dataset", "producerTask": "prepare-data"}
    assert "provision" in tasks["admit"]["dependentTasks"]
    assert "launch" in tasks["train"]["dependentTasks"] and "train" in tasks["verify-checkpoint"]["dependentTasks"]
    assert "verify-checkpoint" in tasks["admit-2"]["dependentTasks"]  # stage 2 waits for stage 1's verification
    for task in [*tasks.values(), root["cleanup"]]:
        assert not task.get("cachingOptions", {}).get("enableCache", False)


def test_components_install_nothing_at_run_time(compiled):
    _, path = compiled
    spec = next(yaml.safe_load_all(path.read_text()))
    for executor in spec["deploymentSpec"]["executors"].values():
        command = " ".join(executor["container"]["command"])
        assert "pip install" not in command
        assert executor["container"]["image"] == "multislice-pipeline:0.1.0"


def test_compile_cli_applies_overrides_as_defaults(tmp_path):
    output = tmp_path / "p.yaml"
    assert cli.main(["compile", "--profile", "local", "--set", "stage1_steps=7", "--output", str(output)]) == 0
    loaded = components.load_component_from_file(str(output))
    assert int(loaded.component_spec.inputs["stage1_steps"].default) == 7


@pytest.mark.parametrize("target", PIPELINE_GOLDENS)
@pytest.mark.parametrize("profile", PROFILES)
def test_compiled_pipeline_matches_golden(profile, target):
    golden = (GOLDEN_DIR / profile / PIPELINE_GOLDENS[target]).read_text(encoding="utf-8")
    assert compiled_pipeline(profile, target) == golden, f"{profile} {target} pipeline changed: run `make goldens`"
