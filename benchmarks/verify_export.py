"""Benchmark: a stage's verification and export as two trainer processes, and as one (``verify_export``).

Run from the project root in the pipeline environment (the trainer environment must exist), in a heavy slot, on a
finished local run's exporting stage::

    heavy .venvs/pipeline/bin/python -m benchmarks.verify_export RUN_DIR [--stage NAME] [--repeats 2]

Each repeat runs, alternating which goes first, on the stage's final checkpoint (its plan read from the run's
plan report):

- ``two``: ``python -m multislice.trainer.verify`` then ``python -m multislice.trainer.export``, each a fresh
  trainer-environment interpreter (what the verify and export steps ran before ``verify_export``);
- ``one``: ``python -m multislice.trainer.verify_export`` (what they run now).

Each writes its export to a scratch directory, not the stage's. Reported per repeat: the wall seconds of each
process, the ``seconds`` each tool reports for its own work, the verdicts, and the load average before and after.
Writes ``benchmarks/results/verify_export.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.preflight import machine
from multislice import reports, storage
from multislice.backends.local import trainer_env, trainer_process_env
from multislice.plan import StagePlan
from multislice.trainer import export, verify, verify_export

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "verify_export.json"


def _timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, env=trainer_process_env(trainer_env()), check=False)
    return round(time.monotonic() - started, 1), done


def _load() -> list[float]:
    with open("/proc/loadavg", encoding="ascii") as handle:
        return [float(x) for x in handle.read().split()[:3]]


def two(stage: StagePlan, out: Path) -> dict:
    """The verifier and the exporter, each in its own process."""
    python = str(trainer_env() / "bin" / "python")
    args = list(stage.maxtext_args)
    verify_wall, verified = _timed(verify.command(stage.checkpoint_dir, stage.final_step, args, python))
    export_wall, exported = _timed(export.command(stage.checkpoint_dir, stage.final_step, str(out), args, python))
    v, e = verify.parse_report(verified.stdout) or {}, verify.parse_report(exported.stdout) or {}
    return {"how": "two", "wall": round(verify_wall + export_wall, 1), "walls": [verify_wall, export_wall],
            "tool_seconds": [v.get("seconds"), e.get("seconds")], "verdicts": [v.get("verdict"), e.get("verdict")],
            "exit": [verified.returncode, exported.returncode]}  # fmt: skip


def one(stage: StagePlan, out: Path) -> dict:
    """The verifier and then the exporter in one process."""
    python = str(trainer_env() / "bin" / "python")
    argv = verify_export.command(stage.checkpoint_dir, stage.final_step, str(out), list(stage.maxtext_args), python)
    wall, done = _timed(argv)
    v, e = verify_export.reports_in(done.stdout)
    v, e = v or {}, e or {}
    return {"how": "one", "wall": wall, "tool_seconds": [v.get("seconds"), e.get("seconds")],
            "verdicts": [v.get("verdict"), e.get("verdict")], "exit": [done.returncode]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the repeats and write :data:`RESULTS`."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("run_dir", help="a finished local run's directory (<output_dir>/<run name>)")
    parser.add_argument("--stage", help="the exporting stage (default: the run's first with export)")
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args(argv)
    plans = sorted(Path(options.run_dir, "reports").glob(f"*/{reports.PlanReport.file_name}"))
    plan = reports.parse(reports.PlanReport, storage.read_json(str(plans[0]))).plan if plans else None
    if plan is None:
        parser.error(f"no plan report under {options.run_dir}/reports")
    stages = [s for s in plan.stages if (s.name == options.stage if options.stage else s.export)]
    if not stages:
        parser.error(f"no stage {options.stage or 'with export'} in {options.run_dir}")
    stage = stages[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="verify-export-") as scratch:
        for repeat in range(options.repeats):
            order = (two, one) if repeat % 2 == 0 else (one, two)
            for how in order:
                before = _load()
                row = how(stage, Path(scratch) / f"{how.__name__}-{repeat}")
                row.update(repeat=repeat, load_before=before, load_after=_load())
                print(json.dumps(row), flush=True)
                rows.append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": machine(), "stage": stage.name, "runs": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
