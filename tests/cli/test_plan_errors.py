"""``multislice plan`` names a stage's field by the stage's index in the profile, the one ``--set`` takes."""

from __future__ import annotations

from multislice import cli, config
from multislice.cli import plan as plan_cli


def test_a_stage_field_error_names_the_profiles_index_not_the_single_stage_specs(monkeypatch, capsys):
    load = config.load_spec

    def refuse_the_single_stage_spec(data, overrides=None):
        if isinstance(data, dict) and len(data.get("stages", [])) == 1:  # the planner's one-stage spec
            raise config.ConfigError([("stages[0] (llama3-70b).data", "stand-in problem")])
        return load(data, overrides)

    monkeypatch.setattr(plan_cli.config, "load_spec", refuse_the_single_stage_spec)
    assert cli.main(["plan", "--profile", "gke-v6e-16x2", "--stage", "llama3-70b"]) == 2
    err = capsys.readouterr().err
    assert "stages[1] (llama3-70b).data: stand-in problem" in err  # llama3-70b is the profile's second stage


def test_the_planner_leaves_the_stages_export_out():
    # the 405B example of docs/preflight.md: llama3-70b's `export: huggingface` cannot export a 405B model
    spec = config.load_profile("gke-v6e-16x2", {})
    assert spec.stage("llama3-70b").export == "huggingface"
    assert cli.main(["plan", "--profile", "gke-v6e-16x2", "--stage", "llama3-70b", "--model", "llama3.1-405b",
                     "--tpu-type", "v5e-4", "--num-slices", "1", "--max-slices", "1"]) == 1  # fmt: skip
