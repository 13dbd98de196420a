"""Goodput of a stage's training, measured as Google's ml-goodput-measurement defines it, from the leader's log.

Google's library (``ml_goodput_measurement`` 0.2.3, ``src/goodput.py``, ``GoodputCalculator``; the one MaxText
0.2.5 records to with ``enable_goodput_recording``: ``maxtext/common/goodput.py``) defines

- **goodput** = productive training time / total job time;
- **productive time**: the time of the steps whose progress was kept, each step once; the first step after a
  (re)start counts only the steady step time, its excess over the mean of the other steps being
  ``PROGRAM_STARTUP`` badput (``_compute_segment_final_metrics``);
- **badput**, by cause (``goodput_utils.BadputType``): ``TPU_INITIALIZATION``, ``TRAINING_PREP``,
  ``PROGRAM_STARTUP`` (compilation), ``DATA_LOADING_SYNC``, ``UNPRODUCTIVE_CHECKPOINT_SAVE_TIME``,
  ``UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME``, ``WASTED_PROGRESS_FROM_DISRUPTION`` (steps trained after the
  restored checkpoint and lost: ``_compute_adjusted_segment_productive_and_unproductive_time``),
  ``INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION`` (from the disruption to the job's restart), and ``OTHER`` (the job
  time no category accounts for: ``_compute_other_unproductive_time``).

The library reads events MaxText writes to Cloud Logging; here the same quantities come from what the train step
already reads, the leader's log lines (:func:`measure`), each with the time the train step read it (lines are
followed as they are written, within ``poll_seconds``), and from the durations the lines themselves carry:

- ``startup`` (Google: ``TPU_INITIALIZATION``, and the start-up Google's job clock does not see): per attempt,
  process start to MaxText imported (the worker's line: Python, JAX and ``jax.distributed`` initialisation, imports);
- ``compile`` (``PROGRAM_STARTUP``): XLA compiles and persistent-cache loads (the worker's compile lines,
  :data:`multislice.metrics.COMPILE_LINE`);
- ``restore`` (``UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME``): Orbax's restore (its ``Finished load in S seconds``);
- ``checkpoint_save`` (``UNPRODUCTIVE_CHECKPOINT_SAVE_TIME``): the blocking part of each save (Orbax's ``Finished
  blocking save in S seconds``; a synchronous save's whole time), taken out of the steps' time, where it falls;
- ``lost_steps`` (``WASTED_PROGRESS_FROM_DISRUPTION``): step records trained again after a restore (each superseded
  record's step time);
- ``waiting`` (``INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION``): between attempts, from the last line of one to the next
  one's process start (failure detection, pod recreation, Kueue re-admission, waiting for capacity);
- ``other`` (``OTHER``): the rest of the job time (state initialisation, data loading, evals, teardown).

The total job time is the train step's wall time, plus the part of the first attempt's start-up that ran
before the train step began following (the launch step started the pods). Categories come from separate
measures; where two overlap (a compile inside the first step beside the first step's excess, cut by the rule
above), ``other`` is what is left and never negative. All times are seconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from multislice import metrics

#: Badput categories, in the order the summary shows them (see the module's docstring).
CATEGORIES = ("startup", "compile", "restore", "checkpoint_save", "lost_steps", "waiting", "other")
#: Each category in words, for the run summary and the pages.
WORDS = {
    "startup": "start-up",
    "compile": "compile",
    "restore": "checkpoint restore",
    "checkpoint_save": "checkpoint save",
    "lost_steps": "steps trained again",
    "waiting": "waiting between attempts",
    "other": "other",
}

#: The worker's first line: a new attempt's leader log starts with it (``multislice.trainer.worker``).
WORKER_START = re.compile(r"multislice worker: process \d+ ")
#: The worker's start-up line: seconds from the process's start to MaxText imported.
STARTUP_LINE = re.compile(r"multislice worker: MaxText imported (?P<seconds>[0-9.]+) s after the process started")
#: Orbax's log line at the end of a checkpoint operation (``orbax/checkpoint/_src/logging/event_tracking.py``,
#: ``OperationRecorder.record_blocking_completion`` and ``record_completion``, orbax-checkpoint as MaxText 0.2.5
#: pins it), e.g. ``[process=0] [async] Finished blocking save in 0.42 seconds. Continuing save @ gs://...``.
ORBAX_LINE = re.compile(
    r"\[process=(?P<process>\d+)\] \[(?P<mode>sync|async)\] Finished (?P<blocking>blocking )?(?P<op>save|load)"
    r"(?P<background> \(blocking \+ background\))? in (?P<seconds>[0-9.]+) seconds"
)


def parse_orbax_line(line: str) -> tuple[str, float] | None:
    """``("restore" | "checkpoint_save", seconds)`` for an Orbax line that is unproductive time, else None.

    A restore counts its whole time (``[sync] Finished load``: training waits for it); a save only what blocks
    the step loop: an async save's blocking part, or a synchronous save's whole time.
    """
    found = ORBAX_LINE.search(line)
    if not found:
        return None
    seconds = float(found["seconds"])
    if found["op"] == "load":
        return ("restore", seconds) if not found["blocking"] else None
    if found["mode"] == "async":
        return ("checkpoint_save", seconds) if found["blocking"] else None
    return ("checkpoint_save", seconds) if not found["blocking"] else None


@dataclass
class Attempt:
    """What the leader's log says of one attempt (one start of the training processes).

    Attributes:
        first_seconds: When its first line was read, seconds since following began.
        last_seconds: When its last line was read.
        startup: Process start to MaxText imported, seconds (None: no start-up line).
        startup_read_at: When the start-up line was read.
        compile: Seconds of XLA compiles and cache loads.
        restore: Seconds of checkpoint restores.
        checkpoint_save: Seconds the step loop was blocked by saves.
        steps: ``(step, step seconds)`` of its step lines, in order.
    """

    first_seconds: float
    last_seconds: float
    startup: float | None = None
    startup_read_at: float | None = None
    compile: float = 0.0
    restore: float = 0.0
    checkpoint_save: float = 0.0
    steps: list[tuple[int, float]] = field(default_factory=list)

    @property
    def started_at(self) -> float:
        """When the attempt's process started, seconds since following began (negative: before)."""
        if self.startup is not None and self.startup_read_at is not None:
            return self.startup_read_at - self.startup
        return self.first_seconds


class Timeline:
    """The attempts of a leader's log, line by line as the train step reads them (:meth:`add`).

    Keeps only what :func:`measure` needs (per attempt its times, durations and step times), not the lines.
    A worker start line (:data:`WORKER_START`) begins an attempt; lines before the first one belong to the
    first attempt.
    """

    def __init__(self) -> None:
        self.attempts: list[Attempt] = []
        self._started = False  # the current attempt has had its worker start line

    def add(self, at: float, line: str) -> None:
        """Take one line, read ``at`` seconds after following began."""
        starts = bool(WORKER_START.search(line))
        if not self.attempts or (starts and self._started):
            self.attempts.append(Attempt(first_seconds=at, last_seconds=at))
        self._started = self._started or starts
        attempt = self.attempts[-1]
        attempt.last_seconds = at
        if started := STARTUP_LINE.search(line):
            attempt.startup, attempt.startup_read_at = float(started["seconds"]), at
        elif compiled := metrics.parse_compile_line(line):
            attempt.compile += compiled["seconds"]
        elif orbax := parse_orbax_line(line):
            kind, seconds = orbax
            setattr(attempt, kind, getattr(attempt, kind) + seconds)
        elif record := metrics.parse_step_line(line):
            attempt.steps.append((int(record["step"]), float(record["perf/step_time_seconds"])))

    def measure(self, wall_seconds: float) -> Goodput:
        """:func:`measure` of the lines taken so far."""
        return measure_attempts(self.attempts, wall_seconds)


def attempts(lines: list[tuple[float, str]]) -> list[Attempt]:
    """The attempts of a leader's log: ``lines`` are ``(seconds since following began, line)``, in order."""
    timeline = Timeline()
    for at, line in lines:
        timeline.add(at, line)
    return timeline.attempts


@dataclass(frozen=True)
class Goodput:
    """A stage's goodput and its badput by cause.

    Attributes:
        goodput: Productive time / job time, 0-1.
        productive_seconds: Productive training time, seconds.
        job_seconds: Total job time, seconds (the denominator).
        badput_seconds: Seconds per category of :data:`CATEGORIES`; with ``productive_seconds`` they sum to
            ``job_seconds`` (``other`` takes the rest), unless the separate measures overlap by more than the rest
            (``other`` is then 0, never negative).
        steps_lost: Step records trained again after a restore.
        attempts: Attempts seen in the leader's log.
    """

    goodput: float
    productive_seconds: float
    job_seconds: float
    badput_seconds: dict[str, float]
    steps_lost: int
    attempts: int

    def report_fields(self) -> dict[str, Any]:
        """The train report's fields (:class:`multislice.reports.TrainReport`), rounded."""
        return {
            "goodput": round(self.goodput, 4),
            "productive_seconds": round(self.productive_seconds, 1),
            "job_seconds": round(self.job_seconds, 1),
            "badput_seconds": {k: round(v, 1) for k, v in self.badput_seconds.items()},
            "steps_lost": self.steps_lost,
        }


def measure(lines: list[tuple[float, str]], wall_seconds: float) -> Goodput:
    """Goodput and badput of a stage from its leader's log lines (see the module's docstring).

    Args:
        lines: ``(seconds since the train step began following, line)`` of every attempt's leader log, in order.
        wall_seconds: How long the train step followed the stage, seconds.

    Returns: the :class:`Goodput`; with no lines or no time, goodput 0 and every second ``other``.
    """
    return measure_attempts(attempts(lines), wall_seconds)


def measure_attempts(found: list[Attempt], wall_seconds: float) -> Goodput:
    """:func:`measure` of a log's attempts (:class:`Timeline`)."""
    lead_in = max(0.0, -found[0].started_at) if found else 0.0
    job = max(0.0, wall_seconds) + lead_in
    # The last occurrence of a step is kept (a step trained again after a restore replaces the one lost).
    kept: dict[int, tuple[int, int]] = {}
    for a, attempt in enumerate(found):
        for i, (step, _) in enumerate(attempt.steps):
            kept[step] = (a, i)
    productive = lost = 0.0
    steps_lost = 0
    for a, attempt in enumerate(found):
        seconds = [s for _, s in attempt.steps]
        steady = sum(seconds[1:]) / (len(seconds) - 1) if len(seconds) > 1 else None
        for i, (step, took) in enumerate(attempt.steps):
            counted = min(took, steady) if i == 0 and steady is not None else took  # first step: PROGRAM_STARTUP
            if kept[step] == (a, i):
                productive += counted
            else:
                lost += counted
                steps_lost += 1
    saves = sum(a.checkpoint_save for a in found)
    productive = max(0.0, productive - saves)  # a save blocks inside a step's time
    pairs = zip(found, found[1:], strict=False)
    waiting = sum(max(0.0, later.started_at - earlier.last_seconds) for earlier, later in pairs)
    badput = {
        "startup": sum(a.startup or 0.0 for a in found),
        "compile": sum(a.compile for a in found),
        "restore": sum(a.restore for a in found),
        "checkpoint_save": saves,
        "lost_steps": lost,
        "waiting": waiting,
    }
    productive = min(productive, job)
    badput["other"] = max(0.0, job - productive - sum(badput.values()))
    return Goodput(
        goodput=productive / job if job > 0 else 0.0,
        productive_seconds=productive,
        job_seconds=job,
        badput_seconds={k: badput[k] for k in CATEGORIES},
        steps_lost=steps_lost,
        attempts=len(found),
    )


def badput_words(badput_seconds: dict[str, float], job_seconds: float | None = None) -> str:
    """``start-up 40.1 s, compile 45.0 s, ...`` (categories with time, in :data:`CATEGORIES` order; with
    ``job_seconds``, each also as a share of it)."""
    parts = []
    for key in CATEGORIES:
        seconds = badput_seconds.get(key, 0.0)
        if seconds <= 0:
            continue
        share = f" ({seconds / job_seconds:.0%})" if job_seconds else ""
        parts.append(f"{WORDS[key]} {seconds:.1f} s{share}")
    return ", ".join(parts) or "none"
