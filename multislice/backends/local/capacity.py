"""The local backend's capacity model: how many emulated slices are available now, and Spot preemption of one.

On a cluster a slice is a node pool (or a Kueue flavor's quota); on Spot capacity GKE can take a whole slice
away (preemption, node-pool repair) and give it back later. This machine has no nodes, so capacity is a file:
``<run_dir>/capacity.json`` lists the run's slices (``slices``) and the ones withdrawn, each with when it comes
back (``until``, epoch seconds) or ``null`` (until :func:`restore`). No file means no limit.

The supervisor (:mod:`.supervisor`) starts a JobSet attempt only when the capacity holds its replicas: an
attempt that does not fit stays ``Pending`` (reason ``InsufficientCapacity``), as a JobSet whose pods cannot be
scheduled does, and starts when the capacity returns. :func:`preempt_slice` withdraws one slice's capacity and
kills its pods' processes (SIGKILL of each process group, as a Spot VM's pods vanish without their grace period),
which makes the JobSet restart (its failure policy) into that wait.

Not modelled: which node a slice would land on (any available slice runs any replicated job), the 30-second
Spot notice (GKE gives a preempted TPU VM's pods their termination grace, at most 30 s), capacity shared between
runs (each run directory has its own file).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from multislice.backends.local.state import read_state

#: The capacity file's name in a run directory.
CAPACITY_FILE = "capacity.json"


def _path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CAPACITY_FILE


def read(run_dir: str | Path) -> dict[str, Any] | None:
    """The capacity file's data (``{"slices": N, "withdrawn": [...]}``), or None when there is none."""
    try:
        return json.loads(_path(run_dir).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def _write(run_dir: str | Path, data: dict[str, Any]) -> None:
    path = _path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def withdrawn(run_dir: str | Path, now: float | None = None) -> list[dict[str, Any]]:
    """The withdrawals still in force at ``now`` (epoch seconds; default the clock)."""
    data = read(run_dir)
    now = time.time() if now is None else now
    return [w for w in (data or {}).get("withdrawn", []) if w.get("until") is None or w["until"] > now]


def available(run_dir: str | Path, now: float | None = None) -> int | None:
    """Slices available at ``now``: the run's slices minus those withdrawn; None when capacity is not modelled."""
    data = read(run_dir)
    if data is None:
        return None
    return max(0, int(data["slices"]) - len({w["slice"] for w in withdrawn(run_dir, now)}))


def next_return(run_dir: str | Path, now: float | None = None) -> float | None:
    """Seconds from ``now`` (epoch seconds; default the clock) until the first withdrawal in force ends by itself
    (its ``until``); None when none does (no file, or every withdrawal lasts until :func:`restore`)."""
    now = time.time() if now is None else now
    ends = [w["until"] for w in withdrawn(run_dir, now) if w.get("until") is not None]
    return max(0.0, min(ends) - now) if ends else None


def withdraw(run_dir: str | Path, slices: int, slice_index: int, seconds: float | None, cause: str) -> dict[str, Any]:
    """Take slice ``slice_index`` of a run of ``slices`` away for ``seconds`` (None: until :func:`restore`).

    Raises:
        ValueError: ``slice_index`` is not one of the run's slices, or ``seconds`` is negative.
    """
    if not 0 <= slice_index < slices:
        raise ValueError(f"slice {slice_index} is not one of the run's {slices} slices (0-{slices - 1})")
    if seconds is not None and seconds < 0:
        raise ValueError(f"--for {seconds:g}: give a duration of 0 seconds or more")
    data = read(run_dir) or {"slices": slices, "withdrawn": []}
    data["slices"] = slices
    entry = {"slice": slice_index, "since": time.time(), "until": None if seconds is None else time.time() + seconds}
    data["withdrawn"] = [w for w in withdrawn(run_dir) if w["slice"] != slice_index] + [{**entry, "cause": cause}]
    _write(run_dir, data)
    return entry


def restore(run_dir: str | Path, slice_index: int | None = None) -> int:
    """Give back slice ``slice_index`` (None: every one); returns how many withdrawals ended."""
    data = read(run_dir)
    if data is None:
        return 0
    keep = [w for w in withdrawn(run_dir) if slice_index is not None and w["slice"] != slice_index]
    ended = len(withdrawn(run_dir)) - len(keep)
    data["withdrawn"] = keep
    _write(run_dir, data)
    return ended


def preempt_slice(run_dir: str | Path, jobset: str, slices: int, slice_index: int, seconds: float | None) -> list[str]:
    """Spot-preempt one slice: withdraw its capacity, then SIGKILL its running pods' process groups.

    Args:
        run_dir: The run directory (local).
        jobset: The JobSet whose pods on that slice (child Job index ``slice_index``) are killed.
        slices: The run's slices (``num_slices``).
        slice_index: Which slice, from 0.
        seconds: How long its capacity stays away (None: until :func:`restore`).

    Returns:
        One line per pod killed.

    Raises:
        ValueError: a slice index outside the run, or a negative duration.
    """
    withdraw(run_dir, slices, slice_index, seconds, f"preempted (JobSet {jobset})")
    state = read_state(Path(run_dir) / "jobsets" / jobset)
    killed = []
    for pod in state.pods if state else []:
        if pod.job_index == slice_index and pod.phase == "Running" and pod.pid:
            try:
                os.killpg(pod.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                continue
            killed.append(f"killed pod {pod.hostname} (slice {slice_index}, pid {pod.pid})")
    return killed
