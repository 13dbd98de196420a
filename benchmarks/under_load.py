"""Run a command (by default the whole test suite) with busy processes beside it, and time it.

Run from the project root::

    .venvs/pipeline/bin/python -m benchmarks.under_load [--busy 2] [-- make test]

or ``make test-under-load``. Each busy process spins on one core for as long as
the command runs (what another job on a shared 2-core CI machine does), so
the command sees a machine with less CPU than it has cores. The busy
processes are stopped however the command ends. Prints the wall time, the
load average before and after, and the command's exit status, which it
returns; appends the same to ``benchmarks/results/under_load.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import subprocess
import time
from pathlib import Path

from benchmarks.preflight import machine

RESULTS = Path(__file__).resolve().parent / "results" / "under_load.jsonl"


def spin() -> None:
    """Use one core until killed."""
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.under_load", description=__doc__.split("\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the command")
    parser.add_argument("command", nargs="*", default=["make", "test"], help="the command (after --)")
    options = parser.parse_args(argv)
    busy = [multiprocessing.Process(target=spin, daemon=True) for _ in range(options.busy)]
    load_before = os.getloadavg()
    for process in busy:
        process.start()
    started = time.monotonic()
    try:
        returncode = subprocess.run(options.command).returncode
    finally:
        for process in busy:
            process.kill()
            process.join()
    seconds = time.monotonic() - started
    record = {
        "date": datetime.date.today().isoformat(),
        "command": options.command,
        "busy_processes": options.busy,
        "seconds": round(seconds, 1),
        "returncode": returncode,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "machine": machine(),
    }
    with open(RESULTS, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(record) + "\n")
    print(
        f"{' '.join(options.command)} beside {options.busy} busy processes: exit {returncode} in "
        f"{seconds / 60:.1f} min (load average {load_before[0]:.1f} before, {record['load_average_after'][0]:.1f} "
        "after)"
    )
    return returncode


if __name__ == "__main__":
    raise SystemExit(main())
