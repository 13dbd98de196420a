"""Training metrics from MaxText's per-step log lines, summarised for the pipeline.

MaxText logs one line per step (``maxtext/common/metric_logger.py``,
``_log_training_metrics``): ``completed step: N, seconds: S, TFLOP/s/device:
T, Tokens/s/device: K, ... loss: L``. The train step reads them from the
leader's log on every backend (:func:`parse_step_line`) into records with
the keys of MaxText's own metrics file (``step``, ``learning/loss``,
``perf/step_time_seconds``, ``perf/per_device_tokens``,
``perf/per_device_tflops``) and writes them as JSON lines to the run
directory. After a JobSet restart MaxText resumes from the last checkpoint
and trains some steps again, so a step can appear twice: the last record of
a step wins.

With an eval split and ``eval_interval``, MaxText also logs ``Completed eval after train step N,
loss=L, perplexity=P, ...`` (``_log_eval_metrics``); :func:`parse_eval_line` makes it a record with
``eval_after_step``, ``eval/avg_loss`` and ``eval/avg_perplexity`` (MaxText's keys), kept in the same
file (it has no ``step`` key, so the per-step readers pass it by); :func:`summarize_eval` summarises them.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from multislice import storage


@dataclass(frozen=True)
class TrainSummary:
    """What a stage's training did, from MaxText's own metrics.

    Attributes:
        steps_recorded: Distinct steps with metrics.
        first_step: First step recorded.
        last_step: Last step recorded.
        first_loss: Loss at the first step recorded.
        final_loss: Loss at the last step recorded.
        step_time_seconds: Mean step time, seconds, over the steady steps: all
            but the first step of each attempt (which includes compilation).
        tokens_per_second_per_device: Tokens per device over the steady steps
            divided by their total time (MaxText dispatches steps
            asynchronously, so single step times alternate between short and
            long; totals do not).
        tflops_per_second_per_device: Model TFLOP per device (MaxText's
            accounting) over the steady steps divided by their total time.
        records: Records read, duplicates included (more than steps after a restart).
    """

    steps_recorded: int
    first_step: int
    last_step: int
    first_loss: float
    final_loss: float
    step_time_seconds: float
    tokens_per_second_per_device: float
    tflops_per_second_per_device: float
    records: int

    def as_dict(self) -> dict[str, Any]:
        """Plain data."""
        return asdict(self)


def parse_records(text: str) -> list[dict[str, Any]]:
    """Metrics records from JSON-lines text, in order; a truncated line (being written) is skipped."""
    records = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_records(location: str) -> list[dict[str, Any]]:
    """The records of a metrics file (a local path or ``gs://``), in file order.

    Raises:
        FileNotFoundError: there is no such file.
    """
    text = storage.read_text(location)
    if text is None:
        raise FileNotFoundError(location)
    return parse_records(text)


def summarize(records: list[dict[str, Any]]) -> TrainSummary:
    """Summarise metrics records (see :class:`TrainSummary`).

    Raises:
        ValueError: no record has a step.
    """
    by_step: dict[int, dict[str, Any]] = {}
    attempt_starts: set[int] = set()
    previous = None
    for record in records:
        if "step" not in record:
            continue
        step = int(record["step"])
        if previous is None or step <= previous:
            attempt_starts.add(step)  # first record of an attempt: its time includes compilation
        previous = step
        by_step[step] = record
    if not by_step:
        raise ValueError("no metrics records with a step: did training start?")
    steps = sorted(by_step)
    steady = [by_step[s] for s in steps if s not in attempt_starts] or [by_step[s] for s in steps]

    seconds = sum(float(r.get("perf/step_time_seconds", 0.0)) for r in steady)

    def per_second(key: str) -> float:
        return sum(float(r.get(key, 0.0)) for r in steady) / seconds if seconds else float("nan")

    return TrainSummary(
        steps_recorded=len(steps),
        first_step=steps[0],
        last_step=steps[-1],
        first_loss=float(by_step[steps[0]]["learning/loss"]),
        final_loss=float(by_step[steps[-1]]["learning/loss"]),
        step_time_seconds=seconds / len(steady),
        tokens_per_second_per_device=per_second("perf/per_device_tokens"),
        tflops_per_second_per_device=per_second("perf/per_device_tflops"),
        records=len(records),
    )


#: MaxText's per-step log line (``maxtext/common/metric_logger.py``), e.g.
#: ``completed step: 5, seconds: 1.234, TFLOP/s/device: 12.300, Tokens/s/device: 456.700, loss: 7.123``.
STEP_LINE = re.compile(
    r"completed step: (?P<step>\d+), seconds: (?P<seconds>[0-9.]+)"
    r"(?:.*?TFLOP/s/device: (?P<tflops>[0-9.]+))?(?:.*?Tokens/s/device: (?P<tokens>[0-9.]+))?"
    r".*?\bloss: (?P<loss>[-0-9.naif]+)"
)


#: MaxText's eval summary line (``maxtext/common/metric_logger.py``, ``_log_eval_metrics``), e.g.
#: ``Completed eval after train step 5, loss=7.123, perplexity=1239.400, total_weights=2048.0, ...``.
EVAL_LINE = re.compile(
    r"Completed eval after train step (?P<step>\d+), loss=(?P<loss>[-0-9.naif]+), perplexity=(?P<ppl>[-0-9.naif]+)"
)


def parse_eval_line(line: str) -> dict[str, Any] | None:
    """An eval record (``eval_after_step``, ``eval/avg_loss``, ``eval/avg_perplexity``) from MaxText's line, or None."""
    found = EVAL_LINE.search(line)
    if not found:
        return None
    return {
        "eval_after_step": int(found["step"]),
        "eval/avg_loss": float(found["loss"]),
        "eval/avg_perplexity": float(found["ppl"]),
    }


COMPILE_LINE = re.compile(
    r"multislice worker: XLA compile of (?P<name>.+?): (?P<seconds>[0-9.]+) s \((?P<source>cache hit|compiled)\)"
)
"""The worker's line per XLA compile of a second or more and per program loaded from the persistent cache
(:func:`multislice.trainer.compile_cache.report_compiles`)."""


def parse_compile_line(line: str) -> dict[str, Any] | None:
    """``{"function", "seconds", "cache_hit"}`` from the worker's compile line, or None.

    ``seconds`` is the time ``jax`` spent in the compile or, on a persistent-cache hit, in loading it.
    """
    found = COMPILE_LINE.search(line)
    if not found:
        return None
    return {"function": found["name"], "seconds": float(found["seconds"]), "cache_hit": found["source"] == "cache hit"}


def compile_seconds_by_attempt(compiles: list[dict[str, Any]]) -> list[tuple[float, int, int]]:
    """Per attempt, in order: the seconds of its compiles (``parse_compile_line`` records with an ``attempt``),
    how many of them the persistent compilation cache served, and how many there were."""
    attempts: dict[int, list[dict[str, Any]]] = {}
    for record in compiles:
        attempts.setdefault(int(record.get("attempt", 0)), []).append(record)
    return [
        (round(sum(r["seconds"] for r in rs), 1), sum(bool(r["cache_hit"]) for r in rs), len(rs))
        for _, rs in sorted(attempts.items())
    ]


#: MaxText's line when it restores the run's own checkpoint (``maxtext/common/checkpointing.py``,
#: ``load_state_if_possible``: ``restoring from this run's directory step {step}``), and when it finds none
#: (``No existing checkpoints found, not restoring checkpoint.``).
RESTORE_LINE = re.compile(r"restoring from this run's directory step (?P<step>\d+)")
NO_CHECKPOINT_LINE = re.compile(r"No existing checkpoints found, not restoring checkpoint")
#: The tier Orbax's emergency ``CheckpointManager`` restores from, logged by every process
#: (``orbax/checkpoint/experimental/emergency/checkpoint_manager.py``, orbax-checkpoint 0.12.8: ``_restore_from_local``
#: ``emergency.CheckpointManager: restoring step=%s from local checkpoint using slice_id: %s`` and
#: ``_restore_from_persistent`` ``... restoring step=%s from persistent checkpoint in directory=%s``), and the same
#: line as ``tiered.CheckpointManager`` from a multi-tier stage's manager (:mod:`multislice.trainer.tiered_checkpoint`).
TIER_LINE = re.compile(
    r"(?:emergency|tiered)\.CheckpointManager: restoring step=(?P<step>\d+) from (?P<tier>local|persistent) checkpoint"
    r"(?: using slice_id: (?P<slice>\d+))?"
)


def parse_restore_line(line: str) -> dict[str, Any] | None:
    """What one leader log line says about the checkpoint a training attempt starts from, or None.

    ``{"step": N}`` (MaxText restores step N of the stage's checkpoints), ``{"step": None}`` (none found: a fresh
    start), or, with emergency checkpoints, ``{"step": N, "tier": "local" | "persistent"}`` (and ``"slice"``: the
    data-parallel replica that held the local checkpoint and broadcast it).
    """
    if found := TIER_LINE.search(line):
        record: dict[str, Any] = {"step": int(found["step"]), "tier": found["tier"]}
        if found["slice"] is not None:
            record["slice"] = int(found["slice"])
        return record
    if found := RESTORE_LINE.search(line):
        return {"step": int(found["step"])}
    if NO_CHECKPOINT_LINE.search(line):
        return {"step": None}
    return None


def eval_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The eval records, one per train step (the last wins, as after a restart), in step order."""
    by_step = {int(r["eval_after_step"]): r for r in records if "eval_after_step" in r}
    return [by_step[s] for s in sorted(by_step)]


def summarize_eval(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``first_eval_loss``, ``final_eval_loss``, ``final_eval_perplexity``, ``evals``; empty without evals."""
    evals = eval_records(records)
    if not evals:
        return {}
    return {
        "first_eval_loss": float(evals[0]["eval/avg_loss"]),
        "final_eval_loss": float(evals[-1]["eval/avg_loss"]),
        "final_eval_perplexity": float(evals[-1]["eval/avg_perplexity"]),
        "evals": len(evals),
    }


def parse_step_line(line: str) -> dict[str, Any] | None:
    """A metrics record (the keys :func:`summarize` reads) from one of MaxText's step log lines, or None.

    The line gives rates per second; the record holds per-step totals
    (rate x step seconds), as MaxText's metrics file does.
    """
    found = STEP_LINE.search(line)
    if not found:
        return None
    seconds = float(found["seconds"])
    return {
        "step": float(found["step"]),
        "learning/loss": float(found["loss"]),
        "perf/step_time_seconds": seconds,
        "perf/per_device_tokens": float(found["tokens"] or 0.0) * seconds,
        "perf/per_device_tflops": float(found["tflops"] or 0.0) * seconds,
    }
