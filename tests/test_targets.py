"""Compile targets through the CLI: kfp carries the kfp-kubernetes platform config, vertex is one document."""

from kfp import components

from multislice import cli
from multislice.delivery import targets


def test_kfp_target_with_node_selector_and_timeouts(tmp_path):
    output = tmp_path / "kfp.yaml"
    assert cli.main(["compile", "--profile", "local", "--target", "kfp", "--output", str(output),
                     "--node-selector", "cloud.google.com/gke-nodepool=pipelines-cpu"]) == 0  # fmt: skip
    spec, platform = targets.documents(output)
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == set(spec["deploymentSpec"]["executors"])  # every task, admit included
    for name, config in executors.items():
        assert config["nodeSelector"] == {"labels": {"cloud.google.com/gke-nodepool": "pipelines-cpu"}}, name
    assert executors["exec-train"]["activeDeadlineSeconds"] == "22200"  # 6 h train wait + 10 min
    assert "activeDeadlineSeconds" not in executors["exec-admit"]  # a Workload may queue for capacity
    assert components.load_component_from_file(str(output)).name == "multislice-training"


def test_vertex_target_is_one_document(tmp_path):
    output = tmp_path / "vertex.yaml"
    assert cli.main(["compile", "--profile", "local", "--target", "vertex", "--output", str(output)]) == 0
    [spec] = targets.documents(output)
    assert spec["pipelineInfo"]["name"] == "multislice-training"
    assert components.load_component_from_file(str(output)).component_spec.inputs["notify_webhook_url"].default == ""
