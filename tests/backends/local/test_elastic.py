"""Elastic training on the local backend with scripted pods: preempt a slice, shrink, grow back at a checkpoint.

The pods are a small Python program standing in for MaxText (as in ``tests/backends/local/test_backend.py``): the leader
logs MaxText's step lines and commits a "checkpoint" (a step directory) every 3 steps, and every attempt resumes
after the latest committed one, as MaxText does. The capacity model, the supervisor, the JobSets, the train step
and its resize policy are the real ones. Event-driven: the preemption and the capacity's return are done from the
train step's ``on_record`` hook, on the step records themselves, and the pods are paced by that hook too: every
pod starts step N only once the train step has read step N-1's line (the hook acknowledges it with a file), so
the leader is never more than one step ahead of what the train step has seen. Nothing waits on a clock: when
the pods ran at their own pace (0.2 s a step) the preemption "after step 4" landed after checkpoint 6 whenever
the train step's 0.5 s log poll (its waits are woken by inotify now) and the supervisor's reaction to the killed
slice took longer than two steps, as on a loaded machine.
"""

import yaml

from multislice import config, storage
from multislice.backends.local import LocalBackend, capacity
from multislice.steps import train

STEPS = 24

POD = """
import os, sys, time
from pathlib import Path
checkpoints, steps, commit, seen = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
who = (int(os.environ["JOB_INDEX"]), int(os.environ["JOB_COMPLETION_INDEX"]))
done = [int(p.name) for p in checkpoints.glob("*") if p.name.isdigit() and (p / commit).exists()]
start = max(done) + 1 if done else 0
began = time.monotonic()
for step in range(start, steps):
    while step > 0 and not (seen / str(step - 1)).exists():  # paced by the train step reading step - 1's line
        time.sleep(0.01)
    if who == (0, 0):
        took, began = time.monotonic() - began, time.monotonic()
        print(f"completed step: {step}, seconds: {took:.3f}, loss: {8.0 - 0.25 * step:.3f}", flush=True)
        if step % 3 == 0 or step == steps - 1:
            (checkpoints / str(step)).mkdir(parents=True, exist_ok=True)
            (checkpoints / str(step) / commit).write_text("")
"""


class ScriptedBackend(LocalBackend):
    """The local backend whose JobSets run the scripted pod; it keeps each JobSet it rendered (MaxText args)."""

    def __init__(self, run_dir, stage, seen):
        super().__init__(run_dir)
        self.stage, self.seen, self.rendered = stage, seen, []

    def workload_manifest(self, plan, stage, pipeline_run_id):
        manifest = super().workload_manifest(plan, stage, pipeline_run_id)
        self.rendered.append(yaml.safe_load(yaml.safe_dump(manifest)))
        pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        pod["containers"][0]["command"] = ["python", "-c", POD]
        pod["containers"][0]["args"] = [self.stage.checkpoint_dir, str(STEPS), storage.COMMIT_FILE, str(self.seen)]
        pod["terminationGracePeriodSeconds"] = 5
        return manifest


def worker_args(manifest) -> dict[str, str]:
    container = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    words = [*container.get("command", []), *container.get("args", [])]
    return dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))


def test_a_preempted_slice_shrinks_the_stage_and_returning_capacity_grows_it_back(tmp_path):
    spec = config.load_profile(
        "local-synthetic",
        {
            "run_name": "elastic",
            "output_dir": str(tmp_path),
            "stages.0.steps": STEPS,
            "stages.0.checkpoint_period": 3,
            "stages.0.elastic": {"min_slices": 1, "wait_for_lost_slice_seconds": 0},
        },
    )
    from multislice.plan import make_plan

    plan = make_plan(spec.with_stages(spec.stages[0]))
    stage = plan.stages[0]
    read = tmp_path / "read"  # one file per step line the train step has read: the pods' pace
    read.mkdir()
    backend = ScriptedBackend(plan.run_dir, stage, read)
    backend.submit(backend.workload_manifest(plan, stage, "run-a"))
    seen = {"preempted": False, "restored": False}

    def on_record(record):
        if record["step"] == 4 and record["slices"] == 2 and not seen["preempted"]:
            seen["preempted"] = True
            killed = capacity.preempt_slice(plan.run_dir, stage.jobset, 2, 1, seconds=None)
            assert killed and all("slice 1" in line for line in killed)
            assert capacity.available(plan.run_dir) == 1
            return  # step 5 never starts on 2 slices: the leader waits until its JobSet is stopped
        if record["slices"] == 1 and not seen["restored"]:
            seen["restored"] = True
            assert capacity.restore(plan.run_dir, 1) == 1
        (read / str(int(record["step"]))).touch()

    report = train.run(plan, stage, {"jobset": stage.jobset}, backend=backend, on_record=on_record)

    assert seen == {"preempted": True, "restored": True}
    assert [(r.from_slices, r.to_slices) for r in report.resizes] == [(2, 1), (1, 2)]
    shrink, grow = report.resizes
    assert "did not return within 0 s" in shrink.cause and "grow from 1" in grow.cause
    assert shrink.resumed_from_step == 3 and shrink.steps_lost == 1  # step 4 was trained again
    # Capacity returned at step 4 on 1 slice; checkpoint 6 is the first committed after it.
    assert grow.resumed_from_step == 6 and grow.cost_seconds is not None
    assert [run["slices"] for run in report.slice_timeline] == [2, 1, 2]
    assert report.slice_timeline[-1]["last_step"] == STEPS - 1
    assert report.last_step == STEPS - 1 and report.steps_lost >= 1 and 0 < report.goodput <= 1
    assert storage.latest_committed_step(stage.checkpoint_dir) == STEPS - 1
    # The 1-slice JobSet: one replicated-job replica, data parallelism 1 over DCN, gradient accumulation 2.
    first, smaller, regrown = backend.rendered
    replicas = [m["spec"]["replicatedJobs"][0]["replicas"] for m in backend.rendered]
    assert replicas == [2, 1, 2]
    assert worker_args(smaller)["gradient_accumulation_steps"] == "2"
    assert worker_args(smaller)["dcn_data_parallelism"] == "1" and worker_args(smaller)["num_slices"] == "1"
    assert "gradient_accumulation_steps" not in worker_args(regrown) and worker_args(regrown)["num_slices"] == "2"
    assert report.global_batch_size == stage.global_batch_size


def test_the_inject_command_withdraws_and_gives_back_a_slice_and_refuses_bad_input(tmp_path, capsys):
    from multislice import cli

    run_dir = tmp_path / "demo"
    run_dir.mkdir()
    common = ["--run", "demo", "--profile", "local", "--output-dir", str(tmp_path)]
    assert cli.main(["inject", "preempt-slice", *common, "--stage", "tiny-8b-recipe", "--slice", "1"]) == 0
    assert "slice 1 of run demo preempted: capacity withdrawn until restore-capacity" in capsys.readouterr().out
    assert capacity.available(run_dir) == 1
    assert cli.main(["inject", "restore-capacity", *common]) == 0
    assert capacity.available(run_dir) == 2
    assert (
        cli.main(["inject", "preempt-slice", *common, "--stage", "tiny-8b-recipe", "--slice", "0", "--for", "0"]) == 0
    )
    assert capacity.available(run_dir) == 2  # a withdrawal of 0 s has already ended
    assert cli.main(["inject", "preempt-slice", *common, "--stage", "tiny-8b-recipe", "--slice", "2"]) == 2
    assert cli.main(["inject", "preempt-slice", *common, "--stage", "nope", "--slice", "0"]) == 2
    out = capsys.readouterr()
    assert "--slice 2 is not a slice of run demo" in out.err + out.out and "Traceback" not in out.err
    gke = ["--run", "demo", "--profile", "gke-v6e-16x2-seed", "--output-dir", str(tmp_path)]
    assert cli.main(["inject", "restore-capacity", *gke]) == 2
