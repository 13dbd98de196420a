"""The train step's report of data read again after restarts on streamed (``hf``) data (issue 25)."""

from __future__ import annotations

from multislice import config
from multislice.delivery.artifacts import train_markdown
from multislice.plan import make_plan
from multislice.reports import TrainReport
from multislice.steps.train import data_reread


def _stage(data: dict):
    overrides = {"output_dir": "/data/out", "stages.0.data": data, "stages.0.steps": 20, "stages.0.eval_interval": -1}
    spec = config.load_profile("local", overrides)
    return make_plan(spec.with_stages(spec.stages[0])).stages[0]


def _report(**fields) -> TrainReport:
    measured = {"steps_trained": 20, "first_loss": 12.0, "final_loss": 9.0, "tokens_per_second_per_device": 100.0}
    return TrainReport(jobset="j", restarts=2, **measured, **fields)


def test_an_hf_stage_says_how_many_steps_read_data_again_after_each_restart():
    stage = _stage({"kind": "hf", "path": "allenai/c4"})
    restores = [
        {"attempt": 0, "step": None},  # a fresh start: nothing trained yet
        {"attempt": 1, "step": 4},  # steps 0-4 kept; the stream starts again: 5 steps re-read
        {"attempt": 2, "step": 14},  # steps 0-14 kept; only 5 steps left to train, each on data seen before
    ]
    assert data_reread(stage, restores) == [
        {"attempt": 1, "restored_step": 4, "steps": 5},
        {"attempt": 2, "restored_step": 14, "steps": 5},
    ]
    text = train_markdown(stage.name, _report(data_reread=data_reread(stage, restores)))
    assert "## data read again" in text and "| 1 | 4 | 5 |" in text.replace("  ", " ")


def test_grain_data_keeps_its_position_so_nothing_is_read_again():
    stage = _stage({"kind": "text", "files": ["site-packages:*.dist-info/METADATA"]})
    assert data_reread(stage, [{"attempt": 1, "step": 4}]) == []
    assert "## data read again" not in train_markdown(stage.name, _report())
