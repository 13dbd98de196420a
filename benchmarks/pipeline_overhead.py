"""Benchmark: what a local pipeline run adds to its training, from kfp.local's log of the run.

Usage (no heavy slot needed: it reads a finished run's log)::

    .venvs/pipeline/bin/python -m benchmarks.pipeline_overhead <run_dir>/pipeline.<id>.log

kfp.local (kfp 2.17 ``kfp/local/task_dispatcher.py``, ``pipeline_orchestrator.py``) logs each task's start
(``Executing task 'NAME'``) and end (``Task 'NAME' finished with status S``) with a time of day, and runs the
tasks one at a time (``kfp/local/orchestrator/dag_orchestrator.py``, ``run_dag``). Printed: each task's seconds,
the pipeline's wall seconds (its first start to its ``Pipeline ... finished`` line), the preflight tasks' and the
train tasks' sums, and issue 28's figure, (pipeline wall - preflight) / train tasks' wall (goal: at most 1.15),
with the time per kind of task (the component's name without its ``-<n>`` suffix).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from datetime import datetime, timedelta

#: ANSI colour codes kfp.local puts around names.
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LINE = re.compile(r"^(\d\d:\d\d:\d\d\.\d+) - INFO - (?:Executing task '([^']+)'|Task '([^']+)' finished with status "
                  r"(\w+)|Running pipeline: '[^']+'|Pipeline '[^']+' finished with status (\w+))")  # fmt: skip


def _kind(task: str) -> str:
    """``train-2`` -> ``train``: the component's name (kfp suffixes the second and later tasks of one)."""
    return re.sub(r"-\d+$", "", task)


def overhead(log: str) -> dict:
    """The tasks' seconds and the figures (see the module docstring) from a kfp.local log's text.

    Raises:
        ValueError: the log has no pipeline start, or a task that started and never finished.
    """
    day = datetime(2000, 1, 1)
    previous: datetime | None = None
    started: dict[str, datetime] = {}
    seconds: dict[str, float] = {}
    begin = end = None
    for raw in log.splitlines():
        found = LINE.match(ANSI.sub("", raw.strip()))
        if not found:
            continue
        at = datetime.combine(day.date(), datetime.strptime(found.group(1), "%H:%M:%S.%f").time())
        if previous is not None and at < previous:  # past midnight
            day += timedelta(days=1)
            at += timedelta(days=1)
        previous = at
        if found.group(2):
            started[found.group(2)] = at
        elif found.group(3):
            seconds[found.group(3)] = (at - started.pop(found.group(3))).total_seconds()
        elif begin is None:
            begin = at
        else:
            end = at
    if begin is None or started:
        raise ValueError(f"no pipeline start, or tasks that never finished: {sorted(started)}")
    wall = ((end or previous or begin) - begin).total_seconds()
    kinds: dict[str, float] = defaultdict(float)
    for task, spent in seconds.items():
        kinds[_kind(task)] += spent
    train, preflight = kinds.get("train", 0.0), kinds.get("preflight", 0.0)
    return {
        "pipeline_wall_seconds": round(wall, 1),
        "preflight_seconds": round(preflight, 1),
        "train_seconds": round(train, 1),
        "wall_over_train": round(wall / train, 3) if train else None,
        "wall_minus_preflight_over_train": round((wall - preflight) / train, 3) if train else None,
        "by_kind": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "tasks": {k: round(v, 1) for k, v in seconds.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Print :func:`overhead` of the log as JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("log", help="a local run's kfp.local log (<run_dir>/pipeline.<id>.log)")
    options = parser.parse_args(argv)
    with open(options.log, encoding="utf-8", errors="replace") as handle:
        print(json.dumps(overhead(handle.read()), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
