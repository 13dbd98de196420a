"""Benchmark: a training worker's import time, as MaxText imports and with :mod:`multislice.trainer.lean_imports`.

Run from the project root in the pipeline environment (the trainer environment must exist), in a heavy slot::

    heavy .venvs/pipeline/bin/python -m benchmarks.train_startup [--repeats 3]

Each repeat starts two fresh trainer-environment interpreters, alternating which goes first, each
importing what ``python -m multislice.trainer.worker`` imports before MaxText's ``train.main`` runs
(the worker module, then ``maxtext.trainers.pre_train.train``):

- ``maxtext``: as MaxText 0.2.5 imports (the worker before this change);
- ``lean``: after :func:`multislice.trainer.lean_imports.install` (the worker now).

Each runs under ``python -X importtime``; reported per repeat: the wall seconds of the imports,
the sum of the top-level cumulative import times, the import time of each of
:data:`multislice.trainer.lean_imports.HEAVY` (as it appears in the profile) and which of them
were really imported, with the load average before and after. Writes
``benchmarks/results/train_startup.json``.

With ``--phases RUN_DIR`` it reads a finished local run instead (no heavy slot needed): for each
JobSet and attempt, the leader pod's start-up phases from its own log (absl's timestamps) and the
local backend's pod record (``jobsets/<name>/state.json``: ``started_at``, ``finished_at``):

- ``imports``: process start to MaxText's first log line (Python, JAX, MaxText; ``jax.distributed``);
- ``setup``: to the checkpoint manager's restore decision (config, mesh, data pipeline, restore);
- ``compile``: to the last compiled program's memory estimate before step 0 (state init, train and
  eval steps), with the worker's per-compile lines summed where it printed them;
- ``first_step``: to the first eval's line (or the first step's, without eval);
- ``steps``: to the last step's line; ``teardown``: from it to the process's exit.
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from benchmarks.preflight import machine
from multislice import metrics
from multislice.backends.local import trainer_env, trainer_process_env
from multislice.trainer.lean_imports import HEAVY

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "train_startup.json"

#: The worker's imports; ``{install}`` is where the lean variant prepares the import system.
SCRIPT = """
import json, sys, time
started = time.monotonic()
import multislice.trainer.worker
from multislice.trainer import lean_imports
{install}
from absl import app
from maxtext.trainers.pre_train import train
print(json.dumps({{"wall_seconds": round(time.monotonic() - started, 2), "loaded": lean_imports.loaded()}}))
"""
VARIANTS = {"maxtext": "", "lean": "lean_imports.install([])"}
LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def profile(stderr: str) -> tuple[float, dict[str, float]]:
    """Sum of top-level cumulative import seconds, and each :data:`HEAVY` package's cumulative seconds."""
    top, heavy = 0.0, {}
    for line in stderr.splitlines():
        found = LINE.match(line)
        if not found:
            continue
        cumulative, depth, name = int(found[2]) / 1e6, len(found[3]) // 2, found[4]
        if depth == 0:
            top += cumulative
        if name in HEAVY:
            heavy[name] = round(heavy.get(name, 0.0) + cumulative, 2)
    return round(top, 2), heavy


def timed_import(variant: str) -> dict:
    """One fresh trainer-environment interpreter importing the worker's modules the ``variant`` way."""
    env = trainer_env()
    done = subprocess.run(
        [str(env / "bin" / "python"), "-X", "importtime", "-c", SCRIPT.format(install=VARIANTS[variant])],
        capture_output=True, text=True, env=trainer_process_env(env), cwd=ROOT, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{variant}: the import failed: {done.stderr[-2000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    top, heavy = profile(done.stderr)
    return {"variant": variant, **measured, "import_seconds_top_level": top, "heavy_import_seconds": heavy}


ABSL = re.compile(r"^[IWEF](\d{4}) (\d\d:\d\d:\d\d\.\d+) +\d+ \S+\] (.*)$")
MARKS = {
    "setup": re.compile(r"No existing checkpoints found|restoring from this run's directory step|Restoring"),
    "compile": re.compile(r"Total estimated memory size"),
    "first_step": re.compile(r"Completed eval after|completed step:"),
}


def _timestamped(log: str, year: int) -> list[tuple[float, str]]:
    """``(epoch seconds, message)`` of each absl line (UTC, as the local backend's pods log)."""
    out = []
    for line in log.splitlines():
        found = ABSL.match(line)
        if found:
            when = time.strptime(f"{year}{found[1]} {found[2].split('.')[0]}", "%Y%m%d %H:%M:%S")
            out.append((calendar.timegm(when) + float("0." + found[2].split(".")[1]), found[3]))
    return out


def attempt_phases(log: str, started_at: float, finished_at: float) -> dict[str, float]:
    """Seconds of each start-up phase of one leader log (see the module's docstring)."""
    lines = _timestamped(log, time.gmtime(started_at).tm_year)
    first_step = next(i for i, (_, m) in enumerate(lines) if m.startswith("completed step:"))
    setup = next(t for t, m in lines if MARKS["setup"].search(m))
    compiled = max(t for t, m in lines[:first_step] if MARKS["compile"].search(m))
    evals = [t for t, m in lines if "Completed eval after" in m]
    steps = [t for t, m in lines if m.startswith("completed step:")]
    marks = [started_at, lines[0][0], setup, compiled, evals[0] if evals else steps[0], steps[-1], finished_at]
    names = ["imports", "setup", "compile", "first_step", "steps", "teardown"]
    phases = {n: round(b - a, 1) for n, a, b in zip(names, marks, marks[1:], strict=False)}
    compiles = [c for c in map(metrics.parse_compile_line, log.splitlines()) if c]
    if compiles:
        phases["xla_compiles"] = round(sum(c["seconds"] for c in compiles), 1)
        phases["xla_cache_hits"] = sum(c["cache_hit"] for c in compiles)
    return phases


def run_phases(run_dir: Path) -> dict[str, list[dict]]:
    """Per JobSet of a finished local run, the leader's :func:`attempt_phases` for each attempt."""
    out = {}
    for state_file in sorted(run_dir.glob("jobsets/*/state.json")):
        state = json.loads(state_file.read_text())
        leaders = [p for p in state.get("pods", []) if p["job_index"] == 0 and p["completion_index"] == 0]
        logs = sorted(state_file.parent.glob("pods/*-0-0.attempt-*.log"))
        attempts = []
        for log in logs:
            attempt = int(log.name.rsplit("attempt-", 1)[1].split(".")[0])
            pod = next((p for p in leaders if p["attempt"] == attempt), None)
            if pod is None or pod["finished_at"] is None:
                continue
            attempts.append({"attempt": attempt, **attempt_phases(log.read_text(), pod["started_at"],
                                                                  pod["finished_at"])})  # fmt: skip
        out[state["name"]] = attempts
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints and writes the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--phases", type=Path, metavar="RUN_DIR", help="a finished local run's start-up phases")
    options = parser.parse_args(argv)
    if options.phases:
        print(json.dumps(run_phases(options.phases), indent=1))
        return 0
    runs = []
    for repeat in range(options.repeats):
        order = ["maxtext", "lean"] if repeat % 2 == 0 else ["lean", "maxtext"]
        for variant in order:
            before = os.getloadavg()
            run = timed_import(variant) | {"load_before": before, "load_after": os.getloadavg()}
            runs.append(run)
            print(json.dumps(run), flush=True)
    summary = {
        v: {"median_wall_seconds": median(r["wall_seconds"] for r in runs if r["variant"] == v)} for v in VARIANTS
    }
    result = {"machine": machine(), "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "summary": summary, "runs": runs}  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
