"""The results API on local run directories: stages, curves, checkpoints, comparison, waiting, run pages."""

import json

import pytest

from multislice import storage
from multislice.delivery import results
from multislice.reports import TrainReport, VerificationReport

STAGES = ["tiny-8b-recipe", "tiny-70b-recipe"]


def local_run(tmp_path, name, losses, verified=True):
    """A local run directory where only the first stage ran: metrics (step 1 twice), reports, checkpoints."""
    run = results.RunRef(name, str(tmp_path), STAGES)
    records = [{"step": s, "learning/loss": loss} for s, loss in enumerate(losses)] + [
        {"step": 1, "learning/loss": 0.5}
    ]
    storage.write_text(f"{run.run_dir}/{STAGES[0]}/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    train = TrainReport(jobset="j", steps_trained=len(losses), first_step=0, last_step=len(losses) - 1,
                        first_loss=losses[0], final_loss=losses[-1], step_time_seconds=1.0,
                        tokens_per_second_per_device=100.0, tflops_per_second_per_device=0.1, records=len(losses),
                        restarts=0)  # fmt: skip
    storage.write_json(f"{run.run_dir}/reports/{STAGES[0]}/train.json", train.to_dict())
    if verified:
        storage.write_json(f"{run.run_dir}/reports/{STAGES[0]}/verification.json",
                           VerificationReport(verdict="PASS").to_dict())  # fmt: skip
    for step in (2, 4):
        storage.write_text(f"{run.run_dir}/{STAGES[0]}/checkpoints/{step}/{storage.COMMIT_FILE}", "")
    storage.path(f"{run.run_dir}/{STAGES[0]}/checkpoints/5").mkdir(parents=True)  # not committed
    return run


def test_stages_curves_checkpoints_and_comparison(tmp_path):
    a = local_run(tmp_path, "run-a", [3.0, 2.0, 1.5, 1.2, 1.0])
    b = local_run(tmp_path, "run-b", [3.0, 2.5], verified=False)
    assert results.stages(a) == [
        {"stage": STAGES[0], "status": "verified", "steps": 5, "latest_checkpoint": 4},
        {"stage": STAGES[1], "status": "not reached", "steps": None, "latest_checkpoint": None},
    ]
    assert results.stages(b)[0]["status"] == "trained"
    assert results.curves(a)[STAGES[0]][:2] == [(0, 3.0), (1, 0.5)]  # the last record of a step wins
    assert results.curves(a)[STAGES[1]] == []
    assert results.checkpoints(a) == {STAGES[0]: [2, 4], STAGES[1]: []}
    table = results.compare_table([a, b]).splitlines()
    assert table[0] == "| run | stage | steps | first loss | final loss | tokens/s per device | restarts | checkpoint |"
    assert table[2].startswith(f"| run-a | {STAGES[0]} | 5 | 3 | 1 |") and table[2].endswith("| PASS |")
    assert table[5].startswith(f"| run-b | {STAGES[1]} |")
    figure = results.plot([a, b])
    assert [ax.get_title() for ax in figure.axes] == STAGES
    assert [line.get_label() for line in figure.axes[0].lines] == ["run-a", "run-b"] and not figure.axes[1].lines


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
