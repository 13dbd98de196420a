"""``multislice render`` shows the shard workers' Job a ``text`` stage creates on GKE (a placeholder of it)."""

from __future__ import annotations

import json

from multislice import cli, config
from multislice.backends import manifests
from multislice.backends.gke import data_workers
from multislice.plan import make_plan
from multislice.render.manifests import object_problems
from multislice.trainer import prepare_shards

TEXT = {"kind": "text", "files": ["gs://my-bucket/corpus/*.jsonl"], "format": "jsonl", "workers": 6}


def text_plan():
    data = config.spec_to_data(config.load_profile("gke-v6e-16x2", {"output_dir": "gs://my-bucket/runs"}))
    data["stages"][0]["data"] = TEXT
    return make_plan(config.load_spec(data))


def test_render_writes_the_shard_workers_job_of_a_text_stage_with_the_values_it_would_have():
    plan = text_plan()
    stage = plan.stages[0]
    rendered = manifests.render_all(plan, "run-1")
    job = rendered[f"job-{stage.name}-data.yaml"]
    assert object_problems(job) == []  # validated like every other object (render_all checks it too)
    assert job["metadata"]["name"] == f"{stage.workload}-data-000000"
    assert "fingerprint" in job["metadata"]["annotations"][data_workers.PLACEHOLDER_ANNOTATION]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 6, 6)
    assert (spec["backoffLimitPerIndex"], spec["maxFailedIndexes"]) == (1, 0)
    container = spec["template"]["spec"]["containers"][0]
    assert container["image"] == plan.spec.images.trainer
    assert container["resources"]["requests"] == {"cpu": data_workers.CPU, "memory": data_workers.MEMORY}
    command = container["command"] + container.get("args", [])
    request = json.loads(command[command.index("--request") + 1])
    assert request["out_dir"] == stage.data_dir and request["data"]["files"] == TEXT["files"]
    # the run's other stage reads synthetic data: no Job for it
    assert [name for name in rendered if name.endswith("-data.yaml")] == [f"job-{stage.name}-data.yaml"]


def test_the_placeholder_request_has_the_fields_of_the_runs(tmp_path):
    plan = text_plan()
    stage = plan.stages[0]
    spec = plan.spec.stage(stage.name)
    sources = [{"path": "a.jsonl", "bytes": 10, "sha256": "x"}]
    real = prepare_shards.work_request(spec.data, spec.tokenizer, spec.max_target_length, str(tmp_path / "d"), sources)
    job = data_workers.placeholder_job(plan, stage, "run-1")
    assert job is not None
    container = job["spec"]["template"]["spec"]["containers"][0]
    command = container["command"] + container.get("args", [])
    placeholder = json.loads(command[command.index("--request") + 1])
    assert placeholder.keys() == real.keys()
    assert {k: placeholder[k] for k in ("data", "tokenizer", "max_target_length")} == {
        k: real[k] for k in ("data", "tokenizer", "max_target_length")
    }


def test_the_render_command_writes_it(tmp_path):
    data = config.spec_to_data(config.load_profile("gke-v6e-16x2", {"output_dir": "gs://my-bucket/runs"}))
    data["stages"][0]["data"] = TEXT
    profile = tmp_path / "text.yaml"
    import yaml

    profile.write_text(yaml.safe_dump(data))
    assert cli.main(["render", "--profile", str(profile), "--output", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / f"job-{data['stages'][0]['name']}-data.yaml").is_file()
