"""Elastic training: which slice counts a stage can train on, and how it keeps its global batch on each.

A stage with ``elastic: {min_slices, max_slices, ...}`` (:class:`multislice.config.ElasticSpec`) trains on
``N = num_slices`` slices when it can and on any runnable ``k`` in ``[min_slices, N]`` when slices are lost
(Spot preemption, node-pool repair). On ``k`` slices:

- the DCN degrees are resolved for ``k`` slices (the ``-1`` axis, by default ``data``, takes ``k / fixed``);
  a stage whose DCN axes are all fixed runs on their product only;
- MaxText's ``gradient_accumulation_steps`` is multiplied by ``N / k``. MaxText's batch arithmetic
  (``maxtext/configs/types.py``, ``calculate_global_batch_sizes``) is ``global_batch_size_to_train_on =
  per_device_batch_size x devices x gradient_accumulation_steps``, so with ``k x chips`` devices and
  ``N / k`` micro-batches the global batch is unchanged, and so are the step sequence and the learning-rate
  schedule (both count optimizer steps). Under manual accumulation MaxText sums the micro-batches' token
  losses and divides by the whole batch's token count (``maxtext/utils/gradient_accumulation.py``), so the
  update equals the one ``N`` slices compute, up to floating-point summation order.

When ``N / k`` is not whole, ``on_indivisible`` decides: ``wait`` (``k`` is not runnable) or
``shrink_batch`` (``floor(N / k)`` micro-batches: a smaller global batch, said so).

Pure functions of the spec: no file, process or API is touched.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict

from multislice import maxtext, storage
from multislice.config.models import RunSpec, Stage

#: MaxText's key for micro-batches per step (``maxtext/configs/base.yml``: ``gradient_accumulation_steps: 1``).
GRADIENT_ACCUMULATION_KEY = "gradient_accumulation_steps"


class SliceCount(BaseModel):
    """How a stage trains on ``slices`` slices (one entry of :func:`slice_counts`).

    Attributes:
        slices: Slices (JobSet replicated-job replicas).
        runnable: Whether the stage may train on this many.
        reason: Why not (``runnable`` false), or what changes (a smaller global batch); '' otherwise.
        dcn: Every DCN axis degree for this count, -1 resolved (empty when not runnable).
        gradient_accumulation_steps: MaxText micro-batches per step on this count.
        global_batch_size: Sequences per optimizer step on this count.
        keeps_global_batch: The global batch equals the full-size one.
        maxtext_args: The stage's MaxText arguments on this count (set by :func:`multislice.plan.make_plan`).
    """

    model_config = ConfigDict(frozen=True)

    slices: int
    runnable: bool
    reason: str = ""
    dcn: dict[str, int] = {}
    gradient_accumulation_steps: int = 1
    global_batch_size: float = 0
    keeps_global_batch: bool = True
    maxtext_args: list[str] = []


def base_accumulation(stage: Stage) -> int:
    """The stage's own ``gradient_accumulation_steps`` (from ``maxtext_overrides``; MaxText's default 1)."""
    value = stage.maxtext_overrides.get(GRADIENT_ACCUMULATION_KEY, 1)
    try:  # validated against MaxText's schema (a positive integer, maybe written as "2" or 2.0)
        return max(1, int(float(str(value))))
    except ValueError:
        return 1


def _dcn_for(stage: Stage, slices: int) -> tuple[dict[str, int] | None, str]:
    degrees = stage.full_dcn()
    fixed = math.prod(d for d in degrees.values() if d != -1)
    described = " x ".join(f"{axis}={degree}" for axis, degree in degrees.items())
    if -1 in degrees.values():
        if slices % fixed:
            return None, f"DCN {described}: the other axes multiply to {fixed}, which does not divide {slices} slices"
    elif fixed != slices:
        return None, f"DCN {described} multiplies to {fixed}, not {slices} slices (no -1 axis to fill)"
    full = {axis: 1 for axis in maxtext.PARALLELISM_AXES}
    full.update(degrees)
    return {axis: (slices // fixed if degree == -1 else degree) for axis, degree in full.items()}, ""


def slice_count(spec: RunSpec, stage: Stage, slices: int) -> SliceCount:
    """How ``stage`` of ``spec`` trains on ``slices`` slices (``maxtext_args`` left empty)."""
    full = spec.num_slices
    elastic = stage.elastic
    chips = spec.slice_type.chips
    base = base_accumulation(stage)
    full_batch = stage.per_device_batch_size * chips * full * base
    dcn, problem = _dcn_for(stage, slices)
    if dcn is None:
        return SliceCount(slices=slices, runnable=False, reason=problem)
    micro = stage.per_device_batch_size * chips * slices
    if not math.isclose(micro, round(micro), rel_tol=1e-9) or round(micro) < 1:
        return SliceCount(
            slices=slices,
            runnable=False,
            reason=f"per_device_batch_size {stage.per_device_batch_size:g} x {chips * slices} chips is "
            f"{micro:g} sequences, not a whole micro-batch",
        )
    if full % slices == 0:
        steps = base * full // slices
        return SliceCount(
            slices=slices, runnable=True, dcn=dcn, gradient_accumulation_steps=steps, global_batch_size=full_batch
        )
    if elastic is None or elastic.on_indivisible == "wait":
        return SliceCount(
            slices=slices,
            runnable=False,
            reason=f"{full} slices / {slices} is not whole, so gradient accumulation cannot keep the global batch "
            f"of {full_batch:g} (on_indivisible: wait)",
        )
    steps = base * (full // slices)
    batch = micro * steps
    return SliceCount(
        slices=slices,
        runnable=True,
        reason=f"global batch {batch:g} instead of {full_batch:g} sequences (on_indivisible: shrink_batch)",
        dcn=dcn,
        gradient_accumulation_steps=steps,
        global_batch_size=batch,
        keeps_global_batch=False,
    )


def slice_counts(spec: RunSpec, stage: Stage) -> list[SliceCount]:
    """Every slice count of an elastic stage, ``max_slices`` first down to ``min_slices``; ``[]`` when not elastic."""
    if stage.elastic is None:
        return []
    low = min(stage.elastic.min_slices, spec.num_slices)
    return [slice_count(spec, stage, k) for k in range(spec.num_slices, low - 1, -1)]


def elastic_issues(spec: RunSpec, stage: Stage, where: str) -> list[tuple[str, str]]:
    """Cross-field checks of a stage's ``elastic``: ``(field, message)`` pairs, empty when fine.

    ``max_slices`` must equal ``num_slices``; ``min_slices`` must be runnable (a floor the stage can train
    on). Counts in between that cannot run are not errors: :func:`slice_counts` says which and why, and the
    stage never relaunches on them.
    """
    elastic = stage.elastic
    if elastic is None:
        return []
    issues = []
    if elastic.max_slices is not None and elastic.max_slices != spec.num_slices:
        issues.append(
            (
                f"{where}.elastic.max_slices",
                f"max_slices {elastic.max_slices} is not num_slices ({spec.num_slices}): a stage grows back to the "
                f"profile's slices; set max_slices to {spec.num_slices} or leave it out",
            )
        )
    if elastic.min_slices > spec.num_slices:
        issues.append(
            (
                f"{where}.elastic.min_slices",
                f"min_slices {elastic.min_slices} exceeds num_slices ({spec.num_slices}); make it at most "
                f"{spec.num_slices}",
            )
        )
        return issues
    floor = slice_count(spec, stage, elastic.min_slices)
    if not floor.runnable and elastic.min_slices != spec.num_slices:
        runnable = [c.slices for c in slice_counts(spec, stage) if c.runnable and c.slices < spec.num_slices]
        hint = f"set min_slices to {min(runnable)}" if runnable else "set dcn so that a -1 axis (data) fills the slices"
        issues.append(
            (
                f"{where}.elastic.min_slices",
                f"the stage cannot train on min_slices={elastic.min_slices}: {floor.reason}; {hint}",
            )
        )
    return issues


def describe(counts: list[SliceCount]) -> str:
    """One line per count, e.g. ``1 slice: gradient_accumulation_steps 2, global batch 64``."""
    lines = []
    for count in counts:
        head = f"{count.slices} slice" + ("s" if count.slices != 1 else "")
        if not count.runnable:
            lines.append(f"{head}: cannot run ({count.reason})")
            continue
        line = f"{head}: gradient_accumulation_steps {count.gradient_accumulation_steps}, global batch "
        line += f"{count.global_batch_size:g}" + (f" ({count.reason})" if count.reason else " (unchanged)")
        lines.append(line)
    return "\n".join(lines)


def to_data(counts: list[SliceCount]) -> list[dict[str, Any]]:
    """Plain data for reports (without the argument lists)."""
    return [c.model_dump(exclude={"maxtext_args"}) for c in counts]


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
