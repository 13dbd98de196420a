"""Benchmark: how soon ``multislice preflight`` returns after it prints its verdict (issue 28).

Run from the project root in the pipeline environment (the trainer environment must exist)::

    .venvs/pipeline/bin/python -m benchmarks.preflight_exit [--repeats 3]

Runs the README's seed 70B check through the CLI, as a user does::

    multislice preflight --profile gke-v6e-16x2-seed --stage seed-llama3-70b --no-alternative --cache-dir DIR

first with an empty verdict cache (cold: one AOT compile for 2 x v6e-16), then with the cache it filled
(cached), ``--repeats`` times each. Every stdout/stderr line is timestamped as it arrives; the verdict line is the
first that says "does not fit" or "fits". Reports, per run, seconds from start to the verdict line and from
the verdict line to the process's exit, with the machine's load average at start and end. Writes
``benchmarks/results/preflight_exit.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.preflight import machine

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "preflight_exit.json"
VERDICT = re.compile(r"does not fit|\bfits\b")


def timed_run(cache: Path) -> dict:
    """One ``multislice preflight`` of the seed 70B: seconds to the verdict line and from it to exit."""
    command = [sys.executable, "-m", "multislice.cli", "preflight", "--profile", "gke-v6e-16x2-seed",
               "--stage", "seed-llama3-70b", "--no-alternative", "--cache-dir", str(cache)]  # fmt: skip
    started = time.monotonic()
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))

    reader = threading.Thread(target=read)
    reader.start()
    returncode = proc.wait()
    ended = time.monotonic() - started
    reader.join()
    verdict = next(((at, line) for at, line in lines if VERDICT.search(line)), None)
    return {
        "returncode": returncode,
        "seconds_total": round(ended, 2),
        "verdict_line": verdict[1] if verdict else None,
        "seconds_to_verdict": round(verdict[0], 2) if verdict else None,
        "seconds_verdict_to_exit": round(ended - verdict[0], 2) if verdict else None,
        "last_lines": [line for _, line in lines[-3:]],
    }


def main() -> None:
    """Cold then cached, ``--repeats`` times; write the results file and print it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    results: dict = {"machine": machine(), "cold": [], "cached": []}
    for _ in range(options.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            results["cold"].append(timed_run(Path(tmp)))
            results["cached"].append(timed_run(Path(tmp)))
    results["machine_at_end"] = machine()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
