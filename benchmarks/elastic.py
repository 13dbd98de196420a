"""Goodput of a 60-step stage with one Spot preemption: elastic (shrink, grow back) vs restart on the same size.

    PYTHONPATH=$PWD .venvs/pipeline/bin/python -m benchmarks.elastic [--delay 20] [--out FILE.json]

Both runs go through the real local backend (JobSets, supervisor, capacity model, train step and its resize
policy) in one invocation. The pods are a scripted stand-in for MaxText, so that the figure is about the policy
and not about this shared 2-core machine's MaxText start-up: each step takes ``STEP_SECONDS x N / k`` on ``k`` of
``N`` slices (gradient accumulation runs N / k micro-batches per step), the leader commits a checkpoint every
``CHECKPOINT_PERIOD`` steps, and every attempt resumes after the latest committed one, as MaxText does. A pod
start costs ``START_SECONDS`` (MaxText's import, distributed init and compile, scaled down).

At step ``PREEMPT_AT`` slice 1 is preempted and its capacity comes back ``--delay`` seconds later:

- **restart on the same size** (no ``elastic``): the JobSet restarts into ``InsufficientCapacity`` and waits for the
  slice, then resumes on 2 slices;
- **elastic** (``wait_for_lost_slice_seconds: 0``): the stage relaunches on 1 slice with gradient accumulation 2,
  and grows back to 2 at the first checkpoint after the capacity returns.

Goodput = productive step time (each step once) / wall time of the train step (:func:`multislice.elastic.goodput`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from multislice import config, elastic, metrics, storage
from multislice.backends.local import LocalBackend, capacity
from multislice.plan import make_plan
from multislice.steps import train

STEPS = 60
CHECKPOINT_PERIOD = 5
PREEMPT_AT = 22
STEP_SECONDS = 0.25
START_SECONDS = 2.0

POD = """
import os, sys, time
from pathlib import Path
checkpoints, steps, commit = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
period, step_seconds, start_seconds, full = int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6]), int(sys.argv[7])
slices = int(os.environ["JAX_PROCESS_COUNT"]) // int(os.environ["PROCESSES_IN_JOB"])
who = (int(os.environ["JOB_INDEX"]), int(os.environ["JOB_COMPLETION_INDEX"]))
time.sleep(start_seconds)
done = [int(p.name) for p in checkpoints.glob("*") if p.name.isdigit() and (p / commit).exists()]
seconds = step_seconds * full / slices
for step in range(max(done) + 1 if done else 0, steps):
    time.sleep(seconds)
    if who == (0, 0):
        print(f"completed step: {step}, seconds: {seconds:.3f}, loss: {8.0 - 0.05 * step:.3f}", flush=True)
        if step % period == 0 or step == steps - 1:
            (checkpoints / str(step)).mkdir(parents=True, exist_ok=True)
            (checkpoints / str(step) / commit).write_text("")
"""


class ScriptedBackend(LocalBackend):
    """The local backend with the scripted pod in place of the MaxText worker."""

    def __init__(self, run_dir, stage, full):
        super().__init__(run_dir)
        self.stage, self.full = stage, full

    def workload_manifest(self, plan, stage, pipeline_run_id):
        manifest = super().workload_manifest(plan, stage, pipeline_run_id)
        pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        pod["containers"][0]["command"] = ["python", "-c", POD]
        pod["containers"][0]["args"] = [
            self.stage.checkpoint_dir, str(STEPS), storage.COMMIT_FILE, str(CHECKPOINT_PERIOD), str(STEP_SECONDS),
            str(START_SECONDS), str(self.full),
        ]  # fmt: skip
        pod["terminationGracePeriodSeconds"] = 5
        return manifest


def run_once(out: Path, name: str, elastic_on: bool, delay: float) -> dict:
    """One run of the stage with one preemption; its wall time, goodput, steps lost and resizes."""
    overrides = {"run_name": name, "output_dir": str(out), "stages.0.steps": STEPS,
                 "stages.0.checkpoint_period": CHECKPOINT_PERIOD, "max_restarts": 4}  # fmt: skip
    if elastic_on:
        overrides["stages.0.elastic"] = {"min_slices": 1, "wait_for_lost_slice_seconds": 0}
    spec = config.load_profile("local", overrides)
    plan = make_plan(spec.with_stages(spec.stages[0]))
    stage = plan.stages[0]
    backend = ScriptedBackend(plan.run_dir, stage, spec.num_slices)
    done = {"preempted": False}

    def on_record(record):
        if int(record["step"]) == PREEMPT_AT and not done["preempted"]:
            done["preempted"] = True
            capacity.preempt_slice(plan.run_dir, stage.jobset, spec.num_slices, 1, seconds=delay)

    backend.submit(backend.workload_manifest(plan, stage, "bench"))
    started = time.monotonic()
    report = train.run(plan, stage, {"jobset": stage.jobset}, backend=backend, on_record=on_record)
    wall = time.monotonic() - started
    records = metrics.parse_records(storage.read_text(stage.metrics_file) or "")
    value, lost = elastic.goodput(records, wall)
    return {
        "policy": "elastic" if elastic_on else "restart on the same size",
        "wall_seconds": round(wall, 1),
        "goodput": round(value, 3),
        "steps_lost": lost,
        "last_step": report.last_step,
        "resizes": [f"{r.from_slices} -> {r.to_slices}: {r.cause} (cost {r.cost_seconds} s)" for r in report.resizes],
        "slice_timeline": report.slice_timeline,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--delay", type=float, default=20.0, help="seconds until the preempted slice's capacity returns"
    )
    parser.add_argument("--out", default="benchmarks/results/elastic.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_once(Path(tmp), "bench-plain", False, args.delay),
                   run_once(Path(tmp), "bench-elastic", True, args.delay)]  # fmt: skip
    data = {
        "machine": {"cpu_cores": os.cpu_count(), "processor": platform.machine(), "load_average": os.getloadavg()},
        "stage": {
            "steps": STEPS,
            "checkpoint_period": CHECKPOINT_PERIOD,
            "preempt_at_step": PREEMPT_AT,
            "capacity_back_after_seconds": args.delay,
            "step_seconds_on_2_slices": STEP_SECONDS,
            "pod_start_seconds": START_SECONDS,
            "pods": "scripted stand-in for MaxText",
        },  # fmt: skip
        "results": results,
    }
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    for r in results:
        print(f"{r['policy']}: goodput {r['goodput']:.3f}, wall {r['wall_seconds']} s, steps lost {r['steps_lost']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
