"""Lineage: the compiled pipeline passes each stage's checkpoint as a KFP Model into verify and export."""

import json

import numpy as np
import pytest
import yaml

from multislice import config, maxtext, reports
from multislice.delivery import lineage
from multislice.errors import InputError
from multislice.plan import make_plan
from multislice.reports import ExportReport, TrainReport
from multislice.trainer.export import compare_logits
from pipelines.multislice_training import compile_pipeline

MODEL = {"schemaTitle": "system.Model", "schemaVersion": "0.0.1"}


@pytest.fixture(scope="module", params=["kfp", "vertex"])
def compiled(request, tmp_path_factory):
    """The local profile's pipeline IR (the PipelineSpec document) for a target."""
    path = tmp_path_factory.mktemp("lineage") / "local.yaml"
    compile_pipeline(config.read_profile("local"), str(path), target=request.param)
    return next(yaml.safe_load_all(path.read_text()))


@pytest.fixture
def plan(tmp_path):
    return make_plan(config.load_profile("local", {"output_dir": str(tmp_path / "out"), "run_name": "lineage"}))


def _task(spec, display_name):
    tasks = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    [(key, task)] = [(k, t) for k, t in tasks.items() if t["taskInfo"]["name"] == display_name]
    return key, task


def test_train_outputs_a_model_that_verify_and_export_consume(compiled):
    spec = config.load_profile("local")
    for stage in spec.stages:
        train_key, train = _task(compiled, f"train {stage.name}")
        outputs = compiled["components"][train["componentRef"]["name"]]["outputDefinitions"]["artifacts"]
        assert outputs["model"]["artifactType"] == MODEL
        _, verify = _task(compiled, f"verify {stage.name}")
        wired = {"taskOutputArtifact": {"outputArtifactKey": "model", "producerTask": train_key}}
        assert verify["inputs"]["artifacts"]["model"] == wired
        inputs = compiled["components"][verify["componentRef"]["name"]]["inputDefinitions"]["artifacts"]
        assert inputs["model"]["artifactType"] == MODEL
        if stage.export:
            export_key, export = _task(compiled, f"export {stage.name}")
            assert export["inputs"]["artifacts"]["model"] == wired
            verify_key, _ = _task(compiled, f"verify {stage.name}")
            assert verify_key in export["dependentTasks"]  # only a verified checkpoint is exported
            component = compiled["components"][export["componentRef"]["name"]]
            assert component["inputDefinitions"]["artifacts"]["model"]["artifactType"] == MODEL
            assert component["outputDefinitions"]["artifacts"]["hf_model"]["artifactType"] == MODEL
        else:
            with pytest.raises(ValueError):
                _task(compiled, f"export {stage.name}")
    assert [s.export for s in spec.stages] == [None, "huggingface"]  # the local profile exports stage 2


def test_export_is_checked_when_the_profile_is_loaded():
    with pytest.raises(config.ConfigError) as error:
        config.load_profile("local", {"stages.tiny-8b-recipe.export": "onnx"})
    assert "stages.0.export" in str(error.value) or "export" in str(error.value)
    plan = make_plan(config.load_profile("local", {"output_dir": "/data/out", "run_name": "x"}))
    assert plan.stages[0].export is None and plan.stages[0].export_dir is None
    assert plan.stages[1].export_dir == f"{plan.stages[1].stage_dir}/export/huggingface"


def test_checkpoint_model_metadata(plan, tmp_path):
    stage = plan.stages[1]
    report = TrainReport(jobset=stage.jobset, final_loss=6.5, first_loss=7.0)
    metadata = lineage.checkpoint_model(plan, stage, report)
    assert set(lineage.CHECKPOINT_FIELDS) <= set(metadata)
    assert metadata["checkpoint_uri"] == f"{stage.checkpoint_dir}/{stage.final_step}"
    assert metadata["step"] == stage.final_step and metadata["final_train_loss"] == 6.5
    assert metadata["maxtext_version"] == maxtext.MAXTEXT_VERSION
    # The count of the model's dimensions: the verifier's count of the synthetic profile's real checkpoint
    # (test_verify reads the twin run of local-synthetic).
    synthetic = make_plan(config.load_profile("local-synthetic", {"output_dir": str(tmp_path / "s"), "run_name": "s"}))
    assert lineage.parameter_count(synthetic, synthetic.stages[0]) == 2_098_432
    assert "final_eval_loss" not in metadata and "data_fingerprint" not in metadata
    written = lineage.write_manifest(str(tmp_path / "model"), metadata)
    assert json.loads(open(written).read()) == metadata


def test_checkpoint_model_and_model_card_carry_eval_loss_and_the_prepared_datas_fingerprint(plan):
    stage = plan.stages[0]

    class WithEval(TrainReport):
        final_eval_loss: float | None = None

    metadata = lineage.checkpoint_model(plan, stage, WithEval(jobset="j", final_loss=5.0, final_eval_loss=5.25))
    assert metadata["final_eval_loss"] == 5.25
    assert "data_fingerprint" not in metadata and reports.model_card(plan, stage)["data_fingerprint"] is None
    # prepare_data's report carries the shards' manifest; its fingerprint (recipe + every source's SHA-256) is the
    # data the stage trained on, in the checkpoint's lineage and in the exported model's card
    manifest = {"fingerprint": "9f2c" * 16, "shards": ["shard-00000.array_record"]}
    reports.write(plan, reports.PrepareDataReport(uri=stage.data_dir, manifest=manifest), stage)
    assert lineage.checkpoint_model(plan, stage, TrainReport(jobset="j"))["data_fingerprint"] == "9f2c" * 16
    assert reports.model_card(plan, stage)["data_fingerprint"] == "9f2c" * 16
    assert reports.model_card(plan, plan.stages[1])["data_fingerprint"] is None  # another stage's data: not this


def test_a_model_of_another_stage_is_refused(plan):
    first, second = plan.stages
    mine = lineage.checkpoint_model(plan, second, TrainReport(jobset=second.jobset))
    lineage.check_input(second, mine)
    with pytest.raises(InputError) as error:
        lineage.check_input(first, mine)
    assert first.checkpoint_dir in str(error.value) and "wire the stage's own train task" in str(error.value)


def test_export_model_metadata_from_the_exporters_report(plan):
    stage = plan.stages[1]
    report = ExportReport.model_validate(
        {"verdict": "PASS", "format": "huggingface", "export_dir": stage.export_dir, "checkpoint_step": 19,
         "parameter_count": 3_672_320, "architecture": "LlamaForCausalLM", "files": ["config.json"],
         "logits_check": {"passed": True, "max_abs_diff": 3.2e-6, "atol": 1e-3, "rtol": 1e-3,
                          "loaders": {"transformers5": {"max_abs_diff": 3.2e-6, "transformers_version": "5.23.0"},
                                      "transformers4": {"max_abs_diff": 4e-6, "transformers_version": "4.57.6"}}},
         "dtype": "bfloat16", "unknown": 1}
    )  # fmt: skip
    metadata = lineage.export_model(stage, report)
    assert set(lineage.EXPORT_FIELDS) <= set(metadata)
    assert metadata["logits_max_abs_diff_by_loader"] == {"5.23.0": 3.2e-6, "4.57.6": 4e-6}
    assert metadata["dtype"] == "bfloat16"
    assert metadata["export_uri"] == stage.export_dir and metadata["logits_check_passed"] is True
    assert metadata["source_checkpoint_uri"] == f"{stage.checkpoint_dir}/{stage.final_step}"


def test_logits_check_passes_float_noise_and_fails_a_scrambled_conversion():
    rng = np.random.default_rng(0)
    reference = rng.normal(0, 2, (16, 64)).astype(np.float32)
    assert compare_logits(reference, reference + 3e-6)["passed"]
    assert not compare_logits(reference, reference + 0.05)["passed"]
    swapped = reference[:, ::-1].copy()
    failed = compare_logits(reference, swapped)
    assert not failed["passed"] and failed["argmax_agree"] < 1.0
    assert not compare_logits(reference, reference[:8])["passed"]  # shapes differ


def test_run_summary_has_the_export_line(plan, tmp_path):
    from multislice.cli.summary import summary_lines
    from multislice.reports import write

    stage = plan.stages[1]
    loaders = {"transformers5": {"max_abs_diff": 3.2e-6, "transformers_version": "5.23.0"},
               "transformers4": {"max_abs_diff": 4.1e-6, "transformers_version": "4.57.6"}}  # fmt: skip
    report = ExportReport(
        verdict="PASS", export_dir=stage.export_dir, dtype="float32",
        logits_check={"max_abs_diff": 3.2e-6, "atol": 1e-3, "rtol": 1e-3, "loaders": loaders},
    )  # fmt: skip
    write(plan, report, stage)
    lines = summary_lines(plan, 60.0, "SUCCEEDED", tmp_path, "0a1b2c3d")
    assert f"  export        PASS: huggingface (float32) at {stage.export_dir}; logits vs MaxText's max |diff| by " \
        "loader: 5.23.0 3.2e-06, 4.57.6 4.1e-06 (tolerance 0.001 + 0.001 x |logit|)" in lines  # fmt: skip
    assert not any(line.startswith("  export") for line in lines[: lines.index(f"stage 2 {stage.name} "
                                                                              f"({stage.model_label}):")])  # fmt: skip


def test_run_summary_of_a_one_slice_stage_says_it_has_no_dcn_axis(tmp_path):
    from multislice.cli.summary import summary_lines
    from multislice.reports import Check, VerificationReport, write

    overrides = {"output_dir": str(tmp_path / "out"), "run_name": "one", "num_slices": 1, "stages.1.dcn.fsdp": 1}
    one = make_plan(config.load_profile("local", overrides))
    stage = one.stages[0]
    report = VerificationReport(verdict="PASS", checks=[Check(name="checksums", passed=True, detail="")],
                                parameter_count=10, written_mesh={"fsdp": 2}, latest_step=4)  # fmt: skip
    write(one, report, stage)
    lines = summary_lines(one, 60.0, "SUCCEEDED", tmp_path, "0a1b2c3d")
    assert "  verification  PASS (1/1 checks passed, 10 parameters, sharded over mesh fsdp=2; DCN none, " \
        "one slice)" in lines  # fmt: skip
    skipped = Check(name="loss_replay", passed=True, skipped=True, detail="skipped: not synthetic data")
    write(one, report.model_copy(update={"checks": [*report.checks, skipped]}), stage)
    lines = summary_lines(one, 60.0, "SUCCEEDED", tmp_path, "0a1b2c3d")
    assert "  verification  PASS (1/2 checks passed, 1 SKIPPED: loss_replay, 10 parameters, sharded over mesh " \
        "fsdp=2; DCN none, one slice)" in lines  # fmt: skip


def test_run_summary_tells_an_elastic_stages_resizes_and_goodput(plan, tmp_path):
    from multislice.cli.summary import summary_lines
    from multislice.elastic import Resize
    from multislice.reports import TrainReport, write

    stage = plan.stages[0]
    shrink = Resize(from_slices=2, to_slices=1, cause="slice 1 lost", detected_at_seconds=41.2,
                    resumed_at_seconds=77.9, last_step_before=7, resumed_from_step=5, steps_lost=2)  # fmt: skip
    grow = Resize(from_slices=1, to_slices=2, cause="capacity back for 2 slices", detected_at_seconds=120.0)
    train = TrainReport(jobset=stage.jobset, steps_trained=15, first_loss=9.0, final_loss=7.0,
                        tokens_per_second_per_device=10.0, restarts=1, resizes=[shrink, grow], goodput=0.625,
                        steps_lost=2)  # fmt: skip
    write(plan, train, stage)
    lines = summary_lines(plan, 60.0, "SUCCEEDED", tmp_path, "0a1b2c3d")
    at = lines.index(next(line for line in lines if line.startswith("  trained       15/")))
    assert lines[at + 1 : at + 4] == [
        "  resized       at 41 s: 2 -> 1 slices (slice 1 lost); resumed from step 5 at 78 s, 2 steps lost",
        "  resized       at 120 s: 1 -> 2 slices (capacity back for 2 slices); not resumed, 0 steps lost",
        "  goodput       0.62 (productive training time / job time, 2 steps trained again)",
    ]


def _measured_report(stage):
    from multislice.reports import TrainReport

    return TrainReport(jobset=stage.jobset, steps_trained=20, first_loss=9.0, final_loss=7.0, restarts=1,
                       step_time_seconds=2.0, tokens_per_second_per_device=10.0, tflops_per_second_per_device=0.1,
                       goodput=0.25, steps_lost=3, productive_seconds=60.0, job_seconds=240.0,
                       badput_seconds={"startup": 70.0, "compile": 80.0, "restore": 2.0, "checkpoint_save": 0.0,
                                       "lost_steps": 6.0, "waiting": 12.0, "other": 10.0})  # fmt: skip


def test_run_summary_tells_every_stages_goodput_and_badput(plan, tmp_path):
    from multislice.cli.summary import summary_lines
    from multislice.reports import write

    stage = plan.stages[0]
    write(plan, _measured_report(stage), stage)
    lines = summary_lines(plan, 60.0, "SUCCEEDED", tmp_path, "0a1b2c3d")
    at = lines.index(next(line for line in lines if line.startswith("  trained       20/")))
    assert lines[at + 1 : at + 3] == [
        "  goodput       0.25 (productive training time / job time, 3 steps trained again)",
        "  badput        start-up 70.0 s (29%), compile 80.0 s (33%), checkpoint restore 2.0 s (1%), "
        "steps trained again 6.0 s (2%), waiting between attempts 12.0 s (5%), other 10.0 s (4%) of a 240 s job",
    ]


def test_the_train_component_logs_goodput_and_each_badput_as_kfp_metrics(plan, tmp_path, monkeypatch):
    """Every stage's KFP Metrics carry goodput, steps lost and ``badput_<cause>_seconds``; resizes only elastic."""
    from components.train import train as component
    from multislice import cancel
    from multislice.delivery import lineage
    from multislice.steps import train as step
    from tests.cancel_driver import Artifact

    stage = plan.stages[0]
    logged: dict[str, float] = {}
    metrics = Artifact(str(tmp_path / "metrics"))
    metrics.log_metric = lambda key, value: logged.__setitem__(key, value)  # type: ignore[method-assign]
    monkeypatch.setattr(cancel, "install", lambda: None)
    monkeypatch.setattr(step, "run", lambda *_: _measured_report(stage))
    monkeypatch.setattr(step, "result_pages", lambda *_: {"html": "<p/>", "markdown": "#"})
    monkeypatch.setattr(lineage, "checkpoint_model", lambda *_: {"uri": "x"})
    monkeypatch.setattr(lineage, "write_manifest", lambda *_: None)
    artifacts = [Artifact(str(tmp_path / name)) for name in ("dataset", "curves", "summary", "model")]
    component(plan.to_json(), stage.name, {}, artifacts[0], metrics, *artifacts[1:])
    assert logged["goodput"] == 0.25 and logged["steps_lost"] == 3
    assert {k: v for k, v in logged.items() if k.startswith("badput_")} == {
        "badput_startup_seconds": 70.0, "badput_compile_seconds": 80.0, "badput_restore_seconds": 2.0,
        "badput_checkpoint_save_seconds": 0.0, "badput_lost_steps_seconds": 6.0, "badput_waiting_seconds": 12.0,
        "badput_other_seconds": 10.0,
    }  # fmt: skip
    assert "resizes" not in logged  # not an elastic stage
