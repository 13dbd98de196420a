"""Benchmark: a kill soak on the local backend with real MaxText.

Run from the project root in the pipeline environment (the trainer environment must exist)::

    .venvs/pipeline/bin/python -m benchmarks.kill_soak [--steps 60] [--kills 10] [--seed 7] [--output DIR]

What it does, on stage 1 of the ``local`` profile (2 emulated slices of
v5litepod-8: 4 trainer processes; checkpoint every 5 steps):

1. an undisturbed run of ``--steps`` steps, for the wall time and step time to compare with;
2. the same stage in another run with ``--kills`` SIGKILLs of a random trainer
   process (pod) plus one SIGKILL of the JobSet's supervisor, at random steps
   (see :class:`Killer`; a repeated step kills the next attempt during its
   start-up or restore). The train step follows the JobSet throughout, as in the pipeline:
   the JobSet's failure policy restarts it after a pod kill, and the train step
   starts a new supervisor after the supervisor kill;
3. the final checkpoint is verified.

For every kill it records the last completed step at the moment of the kill,
the latest committed checkpoint once the next attempt started (every process
of the killed attempt gone), and the step the next attempt
restored (MaxText's "restoring from this run's directory step S" in the
leader's log). Steps lost by a kill = last completed step - restored step
(MaxText's checkpoint N holds the state after step N; a checkpoint whose
asynchronous save was still in flight at the kill is not committed).

Writes ``benchmarks/results/kill_soak.json`` (the machine, every kill, the
totals) and prints a Markdown summary. Goodput here is the time the
undisturbed run needed for the same steps divided by the soak's wall time
(productive time / elapsed time), both from the train step's start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.preflight import machine
from multislice import config, metrics
from multislice.backends.local import LocalJobSets, warm_tools
from multislice.plan import make_plan
from multislice.steps import admit, prepare_data, train, verify_checkpoint
from multislice.storage import latest_committed_step

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "kill_soak.json"
RESTORED = re.compile(r"restoring from this run's directory step (\d+)")
COMPLETED = re.compile(r"completed step: (\d+),")


def stage_plan(output: Path, run_name: str, steps: int, max_restarts: int):
    """The plan of a one-stage run of the local profile's stage 1 with ``steps`` steps, its data prepared (the
    stage trains on ``text`` data: ``prepare_data`` tokenizes it into the output directory's shards, or reuses them)."""
    spec = config.load_profile(
        "local",
        {"run_name": run_name, "output_dir": str(output), "stage1_steps": steps, "max_restarts": max_restarts},
    )
    plan = make_plan(spec)
    prepare_data.run(plan, plan.stages[0])
    return plan, plan.stages[0]


def leader_steps(jobsets: LocalJobSets, name: str, attempt: int) -> list[int]:
    """Steps the leader of ``attempt`` has logged as completed."""
    try:
        text = jobsets.pod_log(name, 0, 0, attempt).read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [int(m) for m in COMPLETED.findall(text)]


def restored_step(jobsets: LocalJobSets, name: str, attempt: int) -> int | None:
    """The checkpoint step an attempt restored, or None (it started from scratch)."""
    try:
        found = RESTORED.findall(jobsets.pod_log(name, 0, 0, attempt).read_text(errors="replace"))
    except FileNotFoundError:
        return None
    return int(found[0]) if found else None


def train_and_time(plan, stage, run_id: str) -> tuple[float, object]:
    """Admit (create the JobSet) and train the stage; returns (seconds, train report)."""
    started = time.monotonic()
    admitted = admit.run(plan, stage, run_id)
    report = train.run(plan, stage, admitted)
    return time.monotonic() - started, report


class Killer(threading.Thread):
    """Kills a random pod (or the supervisor, once) of the stage's JobSet at random steps of its training.

    The kill points are ``kills + 1`` global steps drawn at random from the
    stage (repeats allowed) and taken in order: a kill waits until the current
    attempt's leader has logged that step, or, when the attempt restored a
    checkpoint at or past it, kills the attempt as soon as its pods run
    (during start-up or restore). One kill, not the first, is of the supervisor.
    """

    def __init__(self, plan, stage, kills: int, rng: random.Random):
        super().__init__(daemon=True)
        self.plan, self.stage, self.rng = plan, stage, rng
        self.jobsets = LocalJobSets(plan.run_dir)
        self.points = sorted(rng.randint(1, stage.final_step - 1) for _ in range(kills + 1))
        self.supervisor_kill = rng.randrange(1, kills + 1)
        self.records: list[dict] = []
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as error:  # reported by the caller
            self.error = error

    def _poll(self, until) -> object | None:
        """Poll the JobSet until ``until(state)``; None if it ended first."""
        while not self.done.is_set():
            state = self.jobsets.get_jobset(self.stage.jobset)
            if state is not None:
                if state.terminal and state.reason != "SupervisorLost":
                    return None
                if until(state):
                    return state
            time.sleep(0.2)
        return None

    def _run(self) -> None:
        name = self.stage.jobset
        for index, point in enumerate(self.points):

            def reached(state, point=point):
                if state.phase != "Running" or state.reason == "SupervisorLost" or not state.pods:
                    return False
                restored = restored_step(self.jobsets, name, state.restarts)
                done = leader_steps(self.jobsets, name, state.restarts)
                return (restored is not None and restored >= point) or (bool(done) and done[-1] >= point)

            state = self._poll(reached)
            if state is None:
                return
            attempt = state.restarts
            logged = leader_steps(self.jobsets, name, attempt)
            if index == self.supervisor_kill:
                target, pid = "supervisor", state.supervisor_pid
            else:
                pod = self.rng.choice([p for p in state.pods if p.phase == "Running"])
                target, pid = f"pod slice {pod.job_index} host {pod.completion_index}", pod.pid
            os.kill(pid, signal.SIGKILL)
            self.records.append(
                {
                    "kill": index + 1,
                    "at_step": point,
                    "target": target,
                    "attempt": attempt,
                    "last_completed_step": logged[-1] if logged else None,
                }
            )
            self._poll(lambda s, attempt=attempt: s.restarts > attempt)
            # Read once the next attempt started: the killed attempt's processes are all gone by then.
            self.records[-1]["latest_committed_checkpoint"] = latest_committed_step(self.stage.checkpoint_dir)


def next_restore(jobsets: LocalJobSets, name: str, after: int, last_attempt: int) -> int | None:
    """The step restored by the first attempt after ``after`` that logged its restore (-1: from scratch).

    An attempt killed before MaxText logged its restore trained nothing; the
    next one restores the same checkpoint.
    """
    for attempt in range(after + 1, last_attempt + 1):
        try:
            text = jobsets.pod_log(name, 0, 0, attempt).read_text(errors="replace")
        except FileNotFoundError:
            continue
        if found := RESTORED.findall(text):
            return int(found[0])
        if "No existing checkpoints found" in text:
            return -1
    return None


def prestarted_by_attempt(state) -> list[int]:
    """Per attempt, how many pods started in interpreters the supervisor pre-started (its ``Started`` events:
    ``attempt N: started 4 pods (4 in pre-started interpreters)``)."""
    counts = []
    for event in state.events:
        if event.reason == "Started":
            found = re.search(r"\((\d+) in pre-started interpreters\)", event.message)
            counts.append(int(found[1]) if found else 0)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kill_soak", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs of random pods (one supervisor kill besides)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=None, help="run directory parent (default: a temporary one)")
    parser.add_argument("--skip-baseline", action="store_true", help="no undisturbed run (goodput is not computed)")
    options = parser.parse_args(argv)
    # the soak measures the training's goodput: no verifier importing beside it (multislice.backends.local.warm_tools)
    os.environ[warm_tools.ENV_WARM] = "off"
    output = options.output or Path(tempfile.mkdtemp(prefix="kill-soak-"))
    load_start = os.getloadavg()
    result: dict = {"machine": machine(), "steps": options.steps, "kills_asked": options.kills, "seed": options.seed}

    baseline_seconds = None
    if not options.skip_baseline:
        plan, stage = stage_plan(output, "soak-baseline", options.steps, max_restarts=0)
        baseline_seconds, report = train_and_time(plan, stage, "soak-baseline")
        records = metrics.read_records(stage.metrics_file)  # step records (eval records carry no step time)
        step_seconds = [r["perf/step_time_seconds"] for r in records if "perf/step_time_seconds" in r][1:]
        result["baseline"] = {
            "seconds": round(baseline_seconds, 1),
            "steps_trained": report.steps_trained,
            "median_step_seconds": round(statistics.median(step_seconds), 3) if step_seconds else None,
            "measured_goodput": report.goodput,  # the train report's (multislice.goodput), badput by cause
            "badput_seconds": report.badput_seconds,
        }
        print(f"undisturbed: {options.steps} steps in {baseline_seconds:.0f} s", flush=True)

    plan, stage = stage_plan(output, "soak", options.steps, max_restarts=options.kills + 5)
    killer = Killer(plan, stage, options.kills, random.Random(options.seed))
    killer.start()
    try:
        soak_seconds, report = train_and_time(plan, stage, "soak")
    finally:
        killer.done.set()
        killer.join()
    if killer.error:
        raise killer.error
    jobsets = LocalJobSets(plan.run_dir)
    state = jobsets.get_jobset(stage.jobset)
    for record in killer.records:
        record["restored_step"] = restored = next_restore(jobsets, stage.jobset, record["attempt"], state.restarts)
        last, committed = record["last_completed_step"], record["latest_committed_checkpoint"]
        record["resumed_from_latest_checkpoint"] = restored == (-1 if committed is None else committed)
        record["steps_lost"] = max(0, last - restored) if last is not None and restored is not None else 0
    verdict = verify_checkpoint.run(plan, stage)
    lost = [r["steps_lost"] for r in killer.records]
    result["soak"] = {
        "seconds": round(soak_seconds, 1),
        "kills": killer.records,
        "kills_done": len(killer.records),
        "restarts": state.restarts,
        "resumed_from_latest_checkpoint": sum(r["resumed_from_latest_checkpoint"] for r in killer.records),
        "steps_lost_total": sum(lost),
        "steps_lost_max": max(lost, default=0),
        "checkpoint_period": stage.checkpoint_period,
        "steps_trained": report.steps_trained,
        "last_step": report.last_step,
        "verification": verdict.verdict,
        # The train report's goodput (Google's definitions, multislice.goodput) and its badput by cause.
        "measured_goodput": report.goodput,
        "job_seconds": report.job_seconds,
        "badput_seconds": report.badput_seconds,
        # Per attempt: seconds of XLA compiles, how many the run's persistent cache served, how many there were.
        "compile_seconds_by_attempt": metrics.compile_seconds_by_attempt(report.compiles),
        # Per attempt: how many of its pods started in pre-started interpreters (the local backend's spares).
        "prestarted_pods_by_attempt": prestarted_by_attempt(state),
    }
    if baseline_seconds:
        result["soak"]["wall_time_vs_undisturbed"] = round(soak_seconds / baseline_seconds, 2)
        result["soak"]["goodput"] = round(baseline_seconds / soak_seconds, 3)
    result["load_average"] = {"start": load_start, "end": os.getloadavg()}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")

    soak = result["soak"]
    print("| kill | at step | target | last step done | latest checkpoint | restored | steps lost |")
    print("|---|---|---|---|---|---|---|")
    for r in killer.records:
        print(
            f"| {r['kill']} | {r['at_step']} | {r['target']} | {r['last_completed_step']} "
            f"| {r['latest_committed_checkpoint']} | {r['restored_step']} | {r['steps_lost']} |"
        )
    print(
        f"\n{soak['kills_done']} kills, {soak['restarts']} restarts, "
        f"{soak['resumed_from_latest_checkpoint']}/{soak['kills_done']} resumed from the latest committed checkpoint, "
        f"steps lost {soak['steps_lost_total']} (at most {soak['steps_lost_max']} per kill; checkpoint period "
        f"{soak['checkpoint_period']}), {soak['steps_trained']} steps trained to step {soak['last_step']}, "
        f"verification {soak['verification']}, {soak['seconds']:.0f} s"
        + (f" vs {baseline_seconds:.0f} s undisturbed: goodput {soak['goodput']:.2f}" if baseline_seconds else "")
    )
    print(f"train report: goodput {soak['measured_goodput']}, badput (s) {soak['badput_seconds']}")
    print(
        "XLA compile per attempt: "
        + ", ".join(f"{t:.1f} s ({hits}/{n} from the cache)" for t, hits, n in soak["compile_seconds_by_attempt"])
    )
    print(f"pods started in pre-started interpreters, per attempt: {soak['prestarted_pods_by_attempt']}")
    print(f"results: {RESULTS}")
    ok = (
        soak["verification"] == "PASS"
        and soak["resumed_from_latest_checkpoint"] == soak["kills_done"]
        and soak["steps_lost_max"] <= stage.checkpoint_period
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
