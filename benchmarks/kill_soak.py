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

Every restart is the cluster's cold path: each restarted pod is a new process (the local backend
pre-starts nothing), which imports JAX and MaxText, joins ``jax.distributed``, loads its programs from the
run's persistent compilation cache, restores the checkpoint and trains again from there.

The figure is **goodput as Google defines it** (ml-goodput-measurement: productive training time / job
time, :mod:`multislice.goodput`), the train report's ``measured_goodput``, with its badput by cause. The
soak's wall time over the undisturbed run's is reported too, named ``wall_time_vs_undisturbed``: a
wall-time ratio, not goodput.

Per restart (``restarts``), from the leader's log lines as they appeared (:class:`LineStamper` stamps each
one with the time it was seen, within :data:`STAMP_SECONDS`) and the supervisor's events: detection (the kill
to the supervisor's failure event), restart (that event to the next attempt's pods started: stopping the
survivors), process start to ``jax.distributed`` joined (Python, ``import jax``, the join), imports (to
MaxText imported), compile (and how many programs the persistent cache served), restore, steps redone, the
first step, and ``setup`` (what else the attempt spent before its first step: MaxText's state and data
iterator set-up); and per attempt ``unaccounted``: its time that none of those covers.

Writes ``benchmarks/results/kill_soak.json`` (the machine, every kill and restart, the totals, the load
average) and prints a Markdown summary.
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
from multislice import config, goodput, metrics
from multislice.backends.local import LocalJobSets, warm_tools
from multislice.plan import make_plan
from multislice.steps import admit, prepare_data, train, verify_checkpoint
from multislice.storage import latest_committed_step

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "kill_soak.json"
RESTORED = re.compile(r"restoring from this run's directory step (\d+)")
COMPLETED = re.compile(r"completed step: (\d+),")
#: The worker's ``jax.distributed`` line (:mod:`multislice.trainer.worker`).
JOINED = re.compile(r"jax\.distributed initialised .* (?P<after>[0-9.]+) s after the process started, "
                    r"(?P<joining>[0-9.]+) s of it joining")  # fmt: skip
#: How often :class:`LineStamper` looks at the leader's logs, seconds: the resolution of the per-restart times.
STAMP_SECONDS = 0.1


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
                restored = restored_step(self.jobsets, name, state.attempt)
                done = leader_steps(self.jobsets, name, state.attempt)
                return (restored is not None and restored >= point) or (bool(done) and done[-1] >= point)

            state = self._poll(reached)
            if state is None:
                return
            attempt = state.attempt
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
                    "time": time.time(),
                    "at_step": point,
                    "target": target,
                    "attempt": attempt,
                    "last_completed_step": logged[-1] if logged else None,
                }
            )
            self._poll(lambda s, attempt=attempt: s.attempt > attempt)
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


class LineStamper(threading.Thread):
    """Reads every attempt's leader log as it grows (every :data:`STAMP_SECONDS`) and keeps each line with the
    Unix time it was first seen: ``lines[attempt] = [(time, line), ...]``."""

    def __init__(self, plan, stage):
        super().__init__(daemon=True)
        self.jobsets, self.name = LocalJobSets(plan.run_dir), stage.jobset
        self.lines: dict[int, list[tuple[float, str]]] = {}
        self.offsets: dict[int, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(STAMP_SECONDS):
            self.read()
        self.read()

    def read(self) -> None:
        state = self.jobsets.get_jobset(self.name)
        if state is None:
            return
        for attempt in range(state.attempt + 1):
            try:
                with open(self.jobsets.pod_log(self.name, 0, 0, attempt), "rb") as handle:
                    handle.seek(self.offsets.get(attempt, 0))
                    chunk = handle.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n") + 1
            self.offsets[attempt] = self.offsets.get(attempt, 0) + end
            now = time.time()
            for line in chunk[:end].decode("utf-8", errors="replace").splitlines():
                self.lines.setdefault(attempt, []).append((now, line))


def attempt_phases(lines: list[tuple[float, str]]) -> dict:
    """What one attempt's leader spent where, from its stamped lines (seconds; times are Unix times)."""
    out: dict = {"compile": 0.0, "compiles": 0, "cache_hits": 0, "restore": 0.0, "checkpoint_save": 0.0, "steps": []}
    timed: list[tuple[float, float]] = []  # (seen at, seconds) of each compile and restore
    for at, line in lines:
        if (found := JOINED.search(line)) and "joined_after" not in out:
            out["joined_after"], out["joining"] = float(found["after"]), float(found["joining"])
        elif found := goodput.STARTUP_LINE.search(line):
            out["imported_after"], out["imported_at"] = float(found["seconds"]), at
        elif compiled := metrics.parse_compile_line(line):
            out["compile"] += compiled["seconds"]
            out["compiles"] += 1
            out["cache_hits"] += compiled["cache_hit"]
            timed.append((at, compiled["seconds"]))
        elif orbax := goodput.parse_orbax_line(line):
            out[orbax[0]] += orbax[1]
            if orbax[0] == "restore":
                timed.append((at, orbax[1]))
        elif record := metrics.parse_step_line(line):
            out["steps"].append((int(record["step"]), float(record["perf/step_time_seconds"]), at))
    if "imported_at" in out:
        out["process_started_at"] = out["imported_at"] - out["imported_after"]
    out["last_line_at"] = lines[-1][0] if lines else None
    # Compiles and restores seen before the first step began are outside the steps' times; later ones (the train
    # step's compile at its first call) are inside them.
    begun = out["steps"][0][2] - out["steps"][0][1] if out["steps"] else float("inf")
    out["outside_steps"] = sum(seconds for seen, seconds in timed if seen <= begun)
    if out["steps"] and "imported_at" in out:  # MaxText's set-up: imported to the first step's start, less those
        out["setup"] = max(0.0, begun - out["imported_at"] - out["outside_steps"])
    return out


def restart_costs(records: list[dict], events: list, stamped: dict[int, list[tuple[float, str]]]):
    """Per restart (each attempt after the first), what it cost, in seconds (module docstring); and per attempt
    the time none of the measured parts covers."""
    phases = {a: attempt_phases(stamped.get(a, [])) for a in range(max(stamped, default=-1) + 1)}
    failures = [e for e in events if e.reason in ("JobFailed", "PodFailed", "SupervisorRestarted")]
    starts = [e for e in events if e.reason == "Started"]
    restarts = []
    for attempt in range(1, len(phases)):
        p = phases[attempt]
        started = starts[attempt].time if attempt < len(starts) else None
        failed = max((e.time for e in failures if started is None or e.time <= started), default=None)
        killed = max((r["time"] for r in records if failed is None or r["time"] <= failed), default=None)
        kept = {step for step, _, _ in p["steps"]}
        before = max((s for a in range(attempt) for s, _, _ in phases[a]["steps"]), default=-1)
        redone = [t for step, t, _ in p["steps"] if step <= before]
        first = p["steps"][0] if p["steps"] else None
        entry = {
            "attempt": attempt,
            "detection": _diff(failed, killed),
            "restart": _diff(started, failed),
            "process_start_to_jax_distributed": p.get("joined_after"),
            "jax_distributed_join": p.get("joining"),
            "imports": _diff(p.get("imported_after"), p.get("joined_after")),
            "compile": round(p["compile"], 2),
            "programs_from_cache": f"{p['cache_hits']}/{p['compiles']}",
            "restore": round(p["restore"], 2),
            "first_step": round(first[1], 2) if first else None,
            "steps_redone": len(redone),
            "steps_redone_seconds": round(sum(redone), 2),
            "setup": round(p["setup"], 2) if "setup" in p else None,
            # the kill to the first step past the killed attempt's last one: what the restart cost in all
            "to_new_progress": _diff(next((at for step, _, at in p["steps"] if step > before), None), killed),
            "trained_steps": len(kept),
        }
        restarts.append(entry)
    unaccounted = []
    for attempt, p in phases.items():
        if p.get("process_started_at") is None or p["last_line_at"] is None:
            continue
        span = p["last_line_at"] - p["process_started_at"]
        measured = p["imported_after"] + p["outside_steps"] + p.get("setup", 0.0) + sum(t for _, t, _ in p["steps"])
        last_step_at = p["steps"][-1][2] if p["steps"] else None
        unaccounted.append(
            {
                "attempt": attempt,
                "span": round(span, 1),  # process start to its last line
                "startup": p["imported_after"],
                "compile_restore_before_steps": round(p["outside_steps"], 1),
                "setup": round(p.get("setup", 0.0), 1),
                "steps": round(sum(t for _, t, _ in p["steps"]), 1),
                "checkpoint_save_blocking": round(p["checkpoint_save"], 1),
                "after_last_step": _diff(p["last_line_at"], last_step_at),
                "unaccounted": round(span - measured, 1),
            }
        )
    return restarts, unaccounted


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kill_soak", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kills", type=int, default=10, help="SIGKILLs of random pods (one supervisor kill besides)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=None, help="run directory parent (default: a temporary one)")
    parser.add_argument("--skip-baseline", action="store_true", help="no undisturbed run (no wall_time_vs_undisturbed)")
    parser.add_argument("--json", type=Path, default=RESULTS, help=f"where the results go (default {RESULTS})")
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
    stamper = LineStamper(plan, stage)
    stamper.start()
    killer.start()
    try:
        soak_seconds, report = train_and_time(plan, stage, "soak")
    finally:
        killer.done.set()
        stamper.done.set()
        killer.join()
        stamper.join()
    if killer.error:
        raise killer.error
    jobsets = LocalJobSets(plan.run_dir)
    state = jobsets.get_jobset(stage.jobset)
    for record in killer.records:
        record["restored_step"] = restored = next_restore(jobsets, stage.jobset, record["attempt"], state.attempt)
        last, committed = record["last_completed_step"], record["latest_committed_checkpoint"]
        record["resumed_from_latest_checkpoint"] = restored == (-1 if committed is None else committed)
        record["steps_lost"] = max(0, last - restored) if last is not None and restored is not None else 0
    verdict = verify_checkpoint.run(plan, stage)
    lost = [r["steps_lost"] for r in killer.records]
    restarts, unaccounted = restart_costs(killer.records, state.events, stamper.lines)
    result["soak"] = {
        # Goodput as Google defines it (productive training time / job time: multislice.goodput), by cause
        "measured_goodput": report.goodput,
        "productive_seconds": report.productive_seconds,
        "job_seconds": report.job_seconds,
        "badput_seconds": report.badput_seconds,
        "seconds": round(soak_seconds, 1),
        "kills": killer.records,
        "kills_done": len(killer.records),
        "restarts": state.attempt,
        "restart_strategy": state.restart_strategy,
        "resumed_from_latest_checkpoint": sum(r["resumed_from_latest_checkpoint"] for r in killer.records),
        "steps_lost_total": sum(lost),
        "steps_lost_max": max(lost, default=0),
        "checkpoint_period": stage.checkpoint_period,
        "steps_trained": report.steps_trained,
        "last_step": report.last_step,
        "verification": verdict.verdict,
        # Per attempt: seconds of XLA compiles, how many the run's persistent cache served, how many there were.
        "compile_seconds_by_attempt": metrics.compile_seconds_by_attempt(report.compiles),
        # Per restart: what it cost, phase by phase (seconds); per attempt: its time no phase accounts for.
        "restart_costs": restarts,
        "unaccounted_by_attempt": unaccounted,
    }
    if baseline_seconds:  # a wall-time ratio, not goodput
        result["soak"]["wall_time_vs_undisturbed"] = round(soak_seconds / baseline_seconds, 2)
    result["load_average"] = {"start": load_start, "end": os.getloadavg()}
    result["output"] = str(output)
    options.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")

    soak = result["soak"]
    print(
        f"goodput {soak['measured_goodput']} (productive training time / job time, Google's definition): "
        f"{soak['productive_seconds']} s productive of a {soak['job_seconds']} s job; badput (s) "
        f"{soak['badput_seconds']}"
    )
    print("\n| kill | at step | target | last step done | latest checkpoint | restored | steps lost |")
    print("|---|---|---|---|---|---|---|")
    for r in killer.records:
        print(
            f"| {r['kill']} | {r['at_step']} | {r['target']} | {r['last_completed_step']} "
            f"| {r['latest_committed_checkpoint']} | {r['restored_step']} | {r['steps_lost']} |"
        )
    keys = (
        "detection", "restart", "process_start_to_jax_distributed", "jax_distributed_join", "imports", "compile",
        "programs_from_cache", "restore", "setup", "first_step", "steps_redone_seconds", "to_new_progress",
    )  # fmt: skip
    print("\n| attempt | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in restarts:
        print(f"| {r['attempt']} | " + " | ".join(str(r[k]) for k in keys) + " |")
    print(
        f"\n{soak['kills_done']} kills, {soak['restarts']} restarts ({soak['restart_strategy']}), "
        f"{soak['resumed_from_latest_checkpoint']}/{soak['kills_done']} resumed from the latest committed checkpoint, "
        f"steps lost {soak['steps_lost_total']} (at most {soak['steps_lost_max']} per kill; checkpoint period "
        f"{soak['checkpoint_period']}), {soak['steps_trained']} steps trained to step {soak['last_step']}, "
        f"verification {soak['verification']}, {soak['seconds']:.0f} s"
        + (
            f" (wall time {soak['wall_time_vs_undisturbed']} x the undisturbed run's {baseline_seconds:.0f} s)"
            if baseline_seconds
            else ""
        )
    )
    print(
        "XLA compile per attempt: "
        + ", ".join(f"{t:.1f} s ({hits}/{n} from the cache)" for t, hits, n in soak["compile_seconds_by_attempt"])
    )
    print(f"unaccounted per attempt: {unaccounted}")
    print(f"results: {options.json}")
    ok = (
        soak["verification"] == "PASS"
        and soak["resumed_from_latest_checkpoint"] == soak["kills_done"]
        and soak["steps_lost_max"] <= stage.checkpoint_period
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
