"""Expected goodput of a long multislice training run against the mean time between interruptions (MTBI).

The standard first-order model of checkpoint/restart (Young 1974, "A first order approximation to the optimum
checkpoint interval", CACM 17(9); Daly 2006, "A higher order estimate of the optimum checkpoint interval for
restart dumps", FGCS 22(3)): with interruptions arriving at rate ``1 / M`` (``M`` the MTBI), each one costs

- the restart ``R``: detecting the failure and recreating the pods (a new node if one was lost, with the image
  pulled), the processes' start-up (Python, JAX and ``jax.distributed`` initialisation, imports), the XLA compile
  (cold, or loaded from the persistent compilation cache), and the checkpoint restore; and
- the progress since the last checkpoint the restart restores, on average half a checkpoint interval ``tau / 2``;

and checkpointing itself costs ``c`` (the time a save blocks the step loop) every ``tau``. The fraction of the
job's time that trains is then

    goodput = (1 - sum_i c_i / tau_i) * (1 - (R + tau_r / 2) / M)

with one term ``c_i / tau_i`` per checkpoint tier (persistent on Cloud Storage; emergency: node-local or in memory,
Orbax's emergency checkpoint manager) and ``tau_r`` the period of the tier restored from (the emergency one when it
survived the interruption: a fraction ``emergency_coverage`` of interruptions, the rest from the persistent tier).
Clamped at 0 when interruptions come faster than a restart and half an interval. Young's optimum period is
``sqrt(2 c M)`` (:func:`young_period`), Daly's ``sqrt(2 c (M + R)) - c`` (:func:`daly_period`).

An elastic stage (``elastic`` in the spec) that loses one of ``N`` slices shrinks to ``N - 1`` and goes on at
``(N - 1) / N`` of its throughput (the same global batch through gradient accumulation) instead of waiting
``capacity_wait`` for the slice to come back; it pays a second, planned restart when it grows back (its period
of progress is saved first, so nothing is lost then). :func:`expected_goodput` with ``elastic=True`` charges
``(capacity_wait / N) + restart`` instead of ``capacity_wait`` for each interruption (while the capacity wait is
shorter than ``M``).

Units: seconds throughout; bytes for checkpoint sizes; bytes per second for bandwidths. Pure arithmetic: the
figures (and their sources) are the caller's (``benchmarks/goodput_model.py``, ``docs/goodput.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Restart:
    """The phases of one restart after an interruption, seconds.

    Attributes:
        detect_and_reschedule: From the interruption to the new pods scheduled: failure detection, JobSet
            recreating its child Jobs, and (when a node was lost) the replacement node.
        image_pull: Pulling the trainer image on a node that does not have it.
        startup: Process start to MaxText imported (Python, JAX, ``jax.distributed``, imports).
        compile_cold: XLA compile of the train step (and the programs before it) without a cache.
        compile_cached: The same programs loaded from the persistent compilation cache.
        restore_persistent: Restoring the train state from the persistent (Cloud Storage) checkpoint.
        restore_emergency: Restoring it from the emergency tier (node-local or peers' memory).
    """

    detect_and_reschedule: float
    image_pull: float
    startup: float
    compile_cold: float
    compile_cached: float
    restore_persistent: float
    restore_emergency: float

    def seconds(self, *, compile_cache: bool, from_emergency: bool) -> float:
        """The restart's total, seconds, with or without the compile cache, restoring from one tier."""
        return (
            self.detect_and_reschedule
            + self.image_pull
            + self.startup
            + (self.compile_cached if compile_cache else self.compile_cold)
            + (self.restore_emergency if from_emergency else self.restore_persistent)
        )


@dataclass(frozen=True)
class Stage:
    """A training stage as the model sees it.

    Attributes:
        name: The stage's name.
        step_seconds: Time of one training step (steady state), seconds.
        slices: Slices the stage trains on (``N``; elastic choices need ``N > 1``).
        persistent_period_steps: Steps between persistent checkpoints (``checkpoint_period``).
        persistent_save_blocking: Seconds one persistent save blocks the step loop (async: the device-to-host copy).
        emergency_period_steps: Steps between emergency checkpoints (``local_checkpoint_period``); None: none.
        emergency_save_blocking: Seconds one emergency save blocks the step loop.
        emergency_coverage: Fraction of interruptions after which the emergency tier restores (0-1).
        restart: The restart's phases.
        capacity_wait: After an interruption that takes a slice, seconds until its capacity is back (0: at once).
    """

    name: str
    step_seconds: float
    slices: int
    persistent_period_steps: int
    persistent_save_blocking: float
    restart: Restart
    emergency_period_steps: int | None = None
    emergency_save_blocking: float = 0.0
    emergency_coverage: float = 1.0
    capacity_wait: float = 0.0


@dataclass(frozen=True)
class Prediction:
    """What :func:`expected_goodput` predicts for one stage, MTBI and choice of features.

    Attributes:
        goodput: Expected productive time / job time, 0-1.
        checkpoint_overhead: Fraction of time the saves block (``sum c_i / tau_i``).
        loss_per_interruption: Expected seconds lost per interruption (restart, half an interval, capacity).
        restart_seconds: The expected restart, seconds.
        young_period_steps: Young's optimum persistent checkpoint period for this MTBI, steps.
    """

    goodput: float
    checkpoint_overhead: float
    loss_per_interruption: float
    restart_seconds: float
    young_period_steps: float


def young_period(save_blocking: float, mtbi: float) -> float:
    """Young's optimum checkpoint interval ``sqrt(2 c M)``, seconds (``c`` the save's cost, ``M`` the MTBI).

    Raises:
        ValueError: a negative cost or a non-positive MTBI.
    """
    if save_blocking < 0 or mtbi <= 0:
        raise ValueError(f"need save_blocking >= 0 and mtbi > 0, got {save_blocking}, {mtbi}")
    return math.sqrt(2 * save_blocking * mtbi)


def daly_period(save_blocking: float, mtbi: float, restart: float) -> float:
    """Daly's higher-order optimum ``sqrt(2 c (M + R)) - c`` for ``c < M / 2``, else ``M``; seconds.

    Raises:
        ValueError: a negative cost or restart, or a non-positive MTBI.
    """
    if save_blocking < 0 or restart < 0 or mtbi <= 0:
        raise ValueError(f"need save_blocking >= 0, restart >= 0 and mtbi > 0, got {save_blocking}, {restart}, {mtbi}")
    if save_blocking >= mtbi / 2:
        return mtbi
    return math.sqrt(2 * save_blocking * (mtbi + restart)) - save_blocking


def expected_goodput(
    stage: Stage, mtbi: float, *, emergency: bool, compile_cache: bool, elastic: bool = False
) -> Prediction:
    """Expected goodput of ``stage`` trained for long with one interruption every ``mtbi`` seconds on average.

    Args:
        stage: The stage's figures.
        mtbi: Mean time between interruptions, seconds.
        emergency: Emergency checkpoints on (needs ``stage.emergency_period_steps``).
        compile_cache: Restarts load the compiled programs from the persistent cache.
        elastic: Shrink to ``N - 1`` slices instead of waiting ``capacity_wait`` (needs ``N > 1``).

    Raises:
        ValueError: a non-positive MTBI or step time, ``emergency`` without an emergency period, or ``elastic``
            with one slice.
    """
    if mtbi <= 0 or stage.step_seconds <= 0:
        raise ValueError(f"{stage.name}: need mtbi > 0 and step_seconds > 0, got {mtbi}, {stage.step_seconds}")
    if emergency and not stage.emergency_period_steps:
        raise ValueError(f"{stage.name}: emergency checkpoints need emergency_period_steps")
    if elastic and stage.slices < 2:
        raise ValueError(f"{stage.name}: an elastic stage needs at least 2 slices, has {stage.slices}")
    tau_p = stage.persistent_period_steps * stage.step_seconds + stage.persistent_save_blocking
    overhead = stage.persistent_save_blocking / tau_p
    coverage = 0.0
    tau_e = tau_p
    if emergency:
        assert stage.emergency_period_steps  # checked above
        tau_e = stage.emergency_period_steps * stage.step_seconds + stage.emergency_save_blocking
        overhead += stage.emergency_save_blocking / tau_e
        coverage = min(1.0, max(0.0, stage.emergency_coverage))
    restart = coverage * stage.restart.seconds(compile_cache=compile_cache, from_emergency=True) + (
        1 - coverage
    ) * stage.restart.seconds(compile_cache=compile_cache, from_emergency=False)
    lost_progress = coverage * tau_e / 2 + (1 - coverage) * tau_p / 2
    wait = min(stage.capacity_wait, mtbi)
    if elastic:
        # Go on at (N - 1) / N while the capacity is away, then a planned restart (saved first) to grow back.
        capacity = wait / stage.slices + restart
    else:
        capacity = wait
    loss = restart + lost_progress + capacity
    goodput = max(0.0, 1.0 - overhead) * max(0.0, 1.0 - loss / mtbi)
    young = young_period(stage.persistent_save_blocking, mtbi) / stage.step_seconds
    return Prediction(
        goodput=goodput,
        checkpoint_overhead=overhead,
        loss_per_interruption=loss,
        restart_seconds=restart,
        young_period_steps=young,
    )


def with_period(stage: Stage, persistent_period_steps: int) -> Stage:
    """``stage`` with another persistent checkpoint period (steps)."""
    return replace(stage, persistent_period_steps=persistent_period_steps)


@dataclass(frozen=True)
class Phase:
    """One component of an interruption's cost.

    Attributes:
        name: What it is (``detection``, ``in-place restart``, ``imports``, ``restore (local tier)``, ...).
        seconds: Its duration, seconds.
        source: Where the figure comes from: measured here (a benchmark file), cited (a document or a source
            file), or assumed (said so).
    """

    name: str
    seconds: float
    source: str


@dataclass(frozen=True)
class Interruption:
    """What one interruption of a stage costs, phase by phase, from the failure to the first productive step.

    Attributes:
        stage: The stage's name.
        strategy: How the JobSet restarts (``Recreate``: every pod deleted and created again;
            ``InPlaceRestart``: the pods stay on their nodes and their containers restart, JobSet KEP-467).
        phases: The phases in order; the steps trained again after the restore are one of them.
        checkpoint_overhead: Fraction of the step loop's time the checkpoint saves block (``sum c_i / tau_i``).
    """

    stage: str
    strategy: str
    phases: tuple[Phase, ...]
    checkpoint_overhead: float

    @property
    def seconds(self) -> float:
        """The interruption's total cost, seconds."""
        return sum(phase.seconds for phase in self.phases)

    def goodput(self, mtbi: float) -> float:
        """Expected goodput with one such interruption every ``mtbi`` seconds (the model above, phase-summed):
        ``(1 - checkpoint_overhead) * (1 - seconds / mtbi)``, clamped at 0.

        Raises:
            ValueError: a non-positive MTBI.
        """
        if mtbi <= 0:
            raise ValueError(f"{self.stage}: need mtbi > 0, got {mtbi}")
        return max(0.0, 1.0 - self.checkpoint_overhead) * max(0.0, 1.0 - self.seconds / mtbi)
