"""End to end on the local backend with real MaxText: 2 slices -> 1 (gradient accumulation 2) -> 2, same global batch.

One elastic run of the elastic example profile's stage (``configs/elastic.yaml``: the local-synthetic profile's
8B recipe, tiny Llama 3 architecture, a checkpoint every 3; here 12 steps), shared by the tests here
(session-scoped), so the profile a user runs with ``make run PROFILE=elastic`` is the one shown to shrink and
grow. From the train step's ``on_record`` hook (no clock): once the checkpoint of step 3 is committed, slice 1
is preempted (its processes are SIGKILLed and its capacity withdrawn); the stage relaunches on 1 slice at once
(``wait_for_lost_slice_seconds: 0``); at its first step the capacity comes back, and at the next checkpoint the
stage grows back to 2 slices and trains to the end. The final checkpoint is verified.
"""

import json
import time
from pathlib import Path

import pytest

from multislice import config, storage
from multislice.backends.local import LocalBackend, capacity
from multislice.plan import make_plan
from multislice.steps import train, verify_checkpoint

pytestmark = [pytest.mark.e2e]

STEPS = 12
#: The first loss after a resize is within this fraction of the last loss before it: the global batch, the data
#: (synthetic) and the parameters (restored) are the same, so the curve continues; only the summation order of the
#: gradients differs (2 micro-batches on 1 slice).
LOSS_TOLERANCE = 0.05


@pytest.fixture(scope="session")
def elastic_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("elastic")
    spec = config.load_profile(
        "elastic",  # the example profile: local-synthetic's 8B recipe on synthetic data (nothing to prepare)
        {
            "run_name": "elastic-e2e",
            "output_dir": str(out),
            "stages.0.steps": STEPS,
            "stages.0.elastic.wait_for_lost_slice_seconds": 0,  # relaunch on 1 slice at once (the profile waits 30 s)
        },
    )
    assert spec.stages[0].checkpoint_period == 3 and spec.stages[0].elastic.min_slices == 1
    plan = make_plan(spec.with_stages(spec.stages[0]))
    stage = plan.stages[0]
    backend = LocalBackend(plan.run_dir)
    seen = {"preempted_at": None, "restored_at": None}

    def on_record(record):
        if seen["preempted_at"] is None and (storage.latest_committed_step(stage.checkpoint_dir) or -1) >= 3:
            seen["preempted_at"] = int(record["step"])
            capacity.preempt_slice(plan.run_dir, stage.jobset, 2, 1, seconds=None)
        if record["slices"] == 1 and seen["restored_at"] is None:
            seen["restored_at"] = int(record["step"])
            capacity.restore(plan.run_dir, 1)

    started = time.monotonic()
    backend.submit(backend.workload_manifest(plan, stage, "e2e-elastic"))
    report = train.run(plan, stage, {"jobset": stage.jobset}, backend=backend, on_record=on_record)
    verification = verify_checkpoint.run(plan, stage, "e2e-elastic", backend=backend)
    wall = time.monotonic() - started
    print(f"elastic e2e: {wall:.0f} s wall (train {report.wall_seconds} s), goodput {report.goodput}")
    return {"plan": plan, "stage": stage, "report": report, "verification": verification, "seen": seen, "wall": wall}


def test_the_stage_shrinks_to_one_slice_and_grows_back_finishing_every_step(elastic_run):
    report, seen = elastic_run["report"], elastic_run["seen"]
    assert seen["preempted_at"] is not None and seen["restored_at"] is not None
    assert [(r.from_slices, r.to_slices) for r in report.resizes] == [(2, 1), (1, 2)]
    assert [run["slices"] for run in report.slice_timeline] == [2, 1, 2]
    assert report.last_step == STEPS - 1
    assert storage.latest_committed_step(elastic_run["stage"].checkpoint_dir) == STEPS - 1
    assert 0 < report.goodput < 1 and report.steps_lost >= 0
    assert report.global_batch_size == elastic_run["stage"].global_batch_size


def test_the_run_summary_tells_both_resizes_and_the_goodput(elastic_run, tmp_path):
    from multislice.cli.summary import summary_lines

    lines = summary_lines(elastic_run["plan"], elastic_run["wall"], "SUCCEEDED", tmp_path, "elastic")
    resized = [line for line in lines if line.startswith("  resized       at ")]
    assert [line.split(": ", 1)[1].split(" slices")[0] for line in resized] == ["2 -> 1", "1 -> 2"]
    assert all("steps lost" in line and "resumed from step" in line for line in resized)
    goodput = elastic_run["report"].goodput
    assert f"  goodput       {goodput:.2f} (productive training time / job time" in "\n".join(lines)


def test_the_one_slice_jobset_kept_the_global_batch_with_gradient_accumulation(elastic_run):
    stage = elastic_run["stage"]
    plan = elastic_run["plan"]
    deleted = sorted(Path(plan.run_dir, "jobsets").glob(f"{stage.jobset}.deleted-*"))
    manifests = [(d / "jobset.yaml").read_text() for d in deleted]
    smaller = [m for m in manifests if "gradient_accumulation_steps=2" in m]
    assert smaller and "dcn_data_parallelism=1" in smaller[0] and "num_slices=1" in smaller[0]


def test_the_loss_continues_the_curve_after_each_resize(elastic_run):
    for resize in elastic_run["report"].resizes:
        before, after = resize.last_loss_before, resize.first_loss_after
        assert before is not None and after is not None
        assert abs(after - before) <= LOSS_TOLERANCE * before, (resize, before, after)
    records = [json.loads(line) for line in Path(elastic_run["stage"].metrics_file).read_text().splitlines()]
    by_step: dict[int, list[float]] = {}
    for record in records:
        by_step.setdefault(int(record["step"]), []).append(record["learning/loss"])
    for step, losses in by_step.items():  # a step trained again after a restore gives (nearly) the same loss
        assert max(losses) - min(losses) <= LOSS_TOLERANCE * max(losses), (step, losses)


def test_the_final_checkpoint_verifies(elastic_run):
    assert elastic_run["verification"].verdict == "PASS"
