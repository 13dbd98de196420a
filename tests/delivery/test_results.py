"""The results API on local run directories: stages, curves, checkpoints, comparison, waiting, run pages."""

import importlib.util
import json
from unittest import mock

import pytest

from multislice import storage
from multislice.delivery import results
from multislice.errors import InputError, UserError
from multislice.reports import ExportReport, TrainReport, VerificationReport

STAGES = ["tiny-8b-recipe", "tiny-70b-recipe"]


def local_run(tmp_path, name, losses, verified=True, evals=()):
    """A local run directory where only the first stage ran: metrics (step 1 twice), reports, checkpoints."""
    run = results.RunRef(name, str(tmp_path), STAGES)
    records = [{"step": s, "learning/loss": loss} for s, loss in enumerate(losses)] + [
        {"step": 1, "learning/loss": 0.5}
    ]
    records += [{"eval_after_step": s, "eval/avg_loss": loss, "eval/avg_perplexity": 2.0} for s, loss in evals]
    storage.write_text(f"{run.run_dir}/{STAGES[0]}/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    train = TrainReport(jobset="j", steps_trained=len(losses), first_step=0, last_step=len(losses) - 1,
                        first_loss=losses[0], final_loss=losses[-1], step_time_seconds=1.0,
                        tokens_per_second_per_device=100.0, tflops_per_second_per_device=0.1, records=len(losses),
                        restarts=0, final_eval_loss=evals[-1][1] if evals else None,
                        final_eval_perplexity=2.0 if evals else None)  # fmt: skip
    storage.write_json(f"{run.run_dir}/reports/{STAGES[0]}/train.json", train.to_dict())
    if verified:
        storage.write_json(f"{run.run_dir}/reports/{STAGES[0]}/verification.json",
                           VerificationReport(verdict="PASS").to_dict())  # fmt: skip
    for step in (2, 4):
        storage.write_text(f"{run.run_dir}/{STAGES[0]}/checkpoints/{step}/{storage.COMMIT_FILE}", "")
    storage.path(f"{run.run_dir}/{STAGES[0]}/checkpoints/5").mkdir(parents=True)  # not committed
    return run


def test_stages_curves_checkpoints_and_comparison(tmp_path):
    a = local_run(tmp_path, "run-a", [3.0, 2.0, 1.5, 1.2, 1.0], evals=[(1, 2.5), (3, 1.25)])
    b = local_run(tmp_path, "run-b", [3.0, 2.5], verified=False)
    assert results.stages(a) == [
        {"stage": STAGES[0], "status": "verified", "steps": 5, "latest_checkpoint": 4},
        {"stage": STAGES[1], "status": "not reached", "steps": None, "latest_checkpoint": None},
    ]
    assert results.stages(b)[0]["status"] == "trained"
    assert results.curves(a)[STAGES[0]][:2] == [(0, 3.0), (1, 0.5)]  # the last record of a step wins
    assert results.curves(a)[STAGES[1]] == []
    assert results.curves(a, "eval") == {STAGES[0]: [(1, 2.5), (3, 1.25)], STAGES[1]: []}
    assert results.checkpoints(a) == {STAGES[0]: [2, 4], STAGES[1]: []}
    table = results.compare_table([a, b]).splitlines()
    assert table[0] == ("| run | stage | steps | first loss | final loss | final eval loss | eval perplexity "
                        "| tokens/s per device | restarts | checkpoint | export |")  # fmt: skip
    assert table[2].startswith(f"| run-a | {STAGES[0]} | 5 | 3 | 1 | 1.25 | 2 |") and table[2].endswith("| PASS |  |")
    assert table[5].startswith(f"| run-b | {STAGES[1]} |")
    figure = results.plot([a, b])
    assert [ax.get_title() for ax in figure.axes] == STAGES
    labels = [line.get_label() for line in figure.axes[0].lines]
    assert labels == ["run-a", "run-a eval", "run-b"] and not figure.axes[1].lines
    train_line, eval_line = figure.axes[0].lines[:2]
    assert eval_line.get_color() == train_line.get_color() and eval_line.get_linestyle() == "--"
    assert list(eval_line.get_xdata()) == [1, 3] and list(eval_line.get_ydata()) == [2.5, 1.25]


def test_run_pages():
    assert results.run_url("kfp", "abc", host="http://localhost:8888/") == "http://localhost:8888/#/runs/details/abc"
    assert results.run_url("vertex", "projects/p/locations/us-east5/pipelineJobs/j1", project="p",
                           location="us-east5") == (
        "https://console.cloud.google.com/vertex-ai/locations/us-east5/pipelines/runs/j1?project=p")  # fmt: skip


class Client:
    """A KFP client whose run reports the states given, one per read."""

    def __init__(self, states):
        self.states = list(states)

    def get_run(self, run_id):
        return type("Run", (), {"state": self.states.pop(0) if len(self.states) > 1 else self.states[0]})()


def test_wait_tells_each_change_and_gives_up_after_its_timeout(tmp_path):
    run = local_run(tmp_path, "run-w", [2.0, 1.0])
    run.target, run.handle, run.url = "kfp", Client(["PENDING", "RUNNING", "RUNNING", "SUCCEEDED"]), "page"
    ticks = iter(range(100))
    told = []
    assert results.wait(run, tell=told.append, clock=lambda: next(ticks), pause=lambda s: None) == "SUCCEEDED"
    assert told[0] == "run-w: PENDING (1 s)" and told[1] == f"run-w: stage {STAGES[0]} train reported, final loss 1.000"
    assert [t.split(" (")[0] for t in told if "reported" not in t] == ["run-w: PENDING", "run-w: RUNNING",
                                                                       "run-w: SUCCEEDED"]  # fmt: skip
    run.handle = Client(["RUNNING"])
    with pytest.raises(TimeoutError, match="still RUNNING after 5 s; see page"):
        results.wait(run, timeout=5, tell=told.append, clock=lambda: next(ticks), pause=lambda s: None)
    with pytest.raises(ValueError, match="Ctrl-C"):
        results.cancel(results.RunRef("x", str(tmp_path), STAGES))


def test_the_export_is_a_column_and_loading_it_says_what_is_missing(tmp_path):
    run = local_run(tmp_path, "run-x", [3.0, 2.0])
    with pytest.raises(UserError, match="has no export report") as missing:
        results.load_hf_model(run, STAGES[0])
    assert "stages.N.export" in missing.value.fix
    with pytest.raises(InputError, match="'other' is not a stage of run run-x"):
        results.load_hf_model(run, "other")
    failed = ExportReport(verdict="FAIL", export_dir=f"{tmp_path}/export", logits_check={"passed": False})
    storage.write_json(f"{run.run_dir}/reports/{STAGES[0]}/export.json", failed.to_dict())
    assert results.metrics(run)[STAGES[0]]["export"] == "FAIL"
    with pytest.raises(UserError, match="export is FAIL: logits check"):
        results.load_hf_model(run, STAGES[0])
    passed = ExportReport(verdict="PASS", export_dir=f"{tmp_path}/export")
    storage.write_json(f"{run.run_dir}/reports/{STAGES[0]}/export.json", passed.to_dict())
    row = results.compare([run])[0]
    assert (row["export"], row["export_dir"]) == ("PASS", f"{tmp_path}/export")
    told = []
    run.target, run.handle = "kfp", Client(["SUCCEEDED"])
    results.wait(run, tell=told.append, clock=iter(range(9)).__next__, pause=lambda s: None)
    assert f"run-x: stage {STAGES[0]} export reported, verdict PASS at {tmp_path}/export" in told
    with mock.patch.object(importlib.util, "find_spec", lambda name: None if name == "torch" else "found"):
        with pytest.raises(InputError, match="torch not installed in this Python"):
            results.load_hf_model(run, STAGES[0])
