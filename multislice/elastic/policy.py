"""The elastic policy at run time: when to shrink, wait or grow back, and what a resize cost.

A stage with ``elastic: {min_slices, max_slices, ...}`` trains on any runnable slice count in ``[min_slices, N]``;
which counts are runnable and how each keeps the global batch is :mod:`multislice.config.elastic` (pure arithmetic
of the spec, checked at plan). This module holds the policy the resize controller
(:mod:`multislice.elastic.controller`) applies to what it observes (:func:`decide`), the train report's record of a
resize (:class:`Resize`), and the goodput arithmetic. It knows no backend.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from multislice import storage

# --- the resize policy: when to shrink, wait or grow back ----------------------------------------------------------


class Decision(BaseModel):
    """What :func:`decide` says to do now.

    Attributes:
        action: ``keep`` (train on as is), ``wait`` (for capacity, until ``until``) or ``relaunch`` (on ``slices``).
        slices: The slice count to relaunch on (``relaunch``), else the current one.
        until: For ``wait``: the time (the caller's clock, seconds) at which to decide again, or None (on an event).
        cause: Why, in words (for the train report's resize list).
    """

    model_config = ConfigDict(frozen=True)

    action: str
    slices: int
    until: float | None = None
    cause: str = ""


def decide(
    runnable: list[int],
    *,
    running: int,
    lost_at: float | None,
    available: int,
    now: float,
    wait_seconds: float,
    checkpoint_since_capacity: bool,
) -> Decision:
    """The elastic policy of a stage, as a pure function of what the caller observed.

    Args:
        runnable: The stage's runnable slice counts, most first (:meth:`multislice.plan.StagePlan.runnable_counts`);
            the first is ``num_slices``.
        running: Slices the current workload was launched on.
        lost_at: When the current workload lost a slice (its pods failed, its nodes went), or None while healthy.
        available: Slices whose capacity is available now (local: the capacity model; GKE: what the ClusterQueue can
            admit and the node pools hold).
        now: The caller's clock, seconds (same clock as ``lost_at``).
        wait_seconds: ``elastic.wait_for_lost_slice_seconds``.
        checkpoint_since_capacity: A checkpoint was committed since more capacity became available (growing back
            happens at a checkpoint boundary, so no step is lost).

    Returns:
        A :class:`Decision`. Shrinking waits ``wait_seconds`` from the loss for the capacity to return; growing waits
        for a checkpoint; a loss with no runnable count within the capacity waits for capacity (an event).
    """
    full = runnable[0]
    fitting = [k for k in runnable if k <= available]
    best = fitting[0] if fitting else None
    if lost_at is None:
        if best is not None and best > running and checkpoint_since_capacity:
            return Decision(
                action="relaunch",
                slices=best,
                cause=f"capacity for {best} slices is back; grow from {running} at the checkpoint just committed",
            )
        return Decision(action="keep", slices=running)
    if available >= running:
        target = best if best is not None else running
        return Decision(
            action="relaunch",
            slices=target,
            cause=f"capacity for {target} slices within the wait; restart on {target} from the last checkpoint",
        )
    deadline = lost_at + wait_seconds
    if now < deadline:
        return Decision(
            action="wait",
            slices=running,
            until=deadline,
            cause=f"a slice was lost; waiting up to {wait_seconds:g} s for its capacity",
        )
    if best is None:
        return Decision(
            action="wait",
            slices=running,
            until=None,
            cause=f"only {available} slice(s) available, fewer than the stage's minimum of {runnable[-1]}",
        )
    return Decision(
        action="relaunch",
        slices=best,
        cause=f"a slice was lost and its capacity did not return within {wait_seconds:g} s; shrink from {running} "
        f"to {best} slice(s) (gradient accumulation {full // best if full % best == 0 else full / best:g})",
    )


class Resize(BaseModel):
    """One resize of an elastic stage, for the train report.

    Attributes:
        from_slices: Slices before.
        to_slices: Slices after.
        cause: Why (:attr:`Decision.cause`).
        detected_at_seconds: When the loss (or the capacity) was seen, seconds since training began.
        resumed_at_seconds: When the first step on the new size was logged, seconds since training began.
        last_step_before: The last step logged before the resize.
        resumed_from_step: The checkpoint step training resumed from (the first step after is one more).
        steps_lost: Steps trained after that checkpoint and trained again (``last_step_before - resumed_from_step``).
        cost_seconds: ``resumed_at_seconds - detected_at_seconds``: time with no productive step.
        last_loss_before: Loss of the last step before the resize.
        first_loss_after: Loss of the first step after it (the curve should continue: same global batch).
        checkpoints_discarded: Checkpoint steps the stopped workload committed after the decision whose step line
            was never logged (:func:`discard_unlogged_checkpoints`); training resumed before them.
    """

    from_slices: int
    to_slices: int
    cause: str
    detected_at_seconds: float
    resumed_at_seconds: float | None = None
    last_step_before: int | None = None
    resumed_from_step: int | None = None
    steps_lost: int = 0
    cost_seconds: float | None = None
    last_loss_before: float | None = None
    first_loss_after: float | None = None
    checkpoints_discarded: list[int] = []


def discard_unlogged_checkpoints(checkpoint_dir: str, logged_step: int | None, kept_step: int | None) -> list[int]:
    """Delete the committed checkpoints newer than both the last logged step and ``kept_step``; their steps.

    A workload stopped for a resize goes on training until its processes exit (the pods get SIGTERM and
    ``terminationGracePeriodSeconds``; JAX's preemption notifier keeps MaxText running to its next sync point), so it
    can commit a checkpoint S after the resize was decided. MaxText prints step S's line only when step S+1 completes
    (``maxtext/common/metric_logger.py`` buffers a step's metrics one step), so S's loss may never be logged; the
    relaunch would restore S, and the curve (and the verifier's ``final_loss``, which reads the final steps'
    losses) would lack step S. Deleting S makes the relaunch resume from the newest checkpoint whose steps were all
    logged: at most ``checkpoint_period`` steps are trained again, on the same global batch, and logged.
    A deleted step's digest record (``multislice_digests.json``, :mod:`multislice.trainer.digests`) goes with its
    directory. Should a stopping leader's recorder write one after the delete (on Cloud Storage, where a write
    needs no parent), Orbax removes that uncommitted directory before it saves the step again
    (``orbax/checkpoint/_src/path/atomicity.py``), and a record not of the current commit is written again.

    Args:
        checkpoint_dir: The stage's checkpoint directory (local or ``gs://``).
        logged_step: The last step whose line was read (None: none).
        kept_step: The newest checkpoint committed when the resize was decided (None: none); never deleted, nor any
            older (a resumed run's earlier checkpoints have no line in this run).

    Returns: the deleted steps, ascending.
    """
    floor = max(-1 if logged_step is None else logged_step, -1 if kept_step is None else kept_step)
    doomed = [step for step in storage.committed_steps(checkpoint_dir) if step > floor]
    for step in doomed:
        storage.path(checkpoint_dir).joinpath(str(step)).rmtree()
    return doomed


def goodput(records: list[dict[str, Any]], wall_seconds: float) -> tuple[float, int]:
    """(productive training time / wall time, steps lost) of a stage from its step records.

    A step counts once, at its last occurrence (a step trained again after a restore replaces the one lost);
    productive time is the sum of those steps' ``perf/step_time_seconds``. Steps lost are the step records that
    were trained again. Returns ``(0.0, lost)`` for no wall time.
    """
    last: dict[int, float] = {}
    for record in records:
        last[int(record["step"])] = float(record.get("perf/step_time_seconds", 0.0))
    lost = len(records) - len(last)
    if wall_seconds <= 0:
        return 0.0, lost
    return min(1.0, sum(last.values()) / wall_seconds), lost


def slice_timeline(records: list[dict[str, Any]]) -> list[dict[str, int]]:
    """Slice count per step as runs: ``[{"first_step", "last_step", "slices"}, ...]`` from records carrying ``slices``.

    In logging order, so a step trained again after a resize starts a new run.
    """
    runs: list[dict[str, int]] = []
    for record in records:
        step, slices = int(record["step"]), int(record.get("slices", 0))
        if runs and runs[-1]["slices"] == slices and step == runs[-1]["last_step"] + 1:
            runs[-1]["last_step"] = step
        else:
            runs.append({"first_step": step, "last_step": step, "slices": slices})
    return runs
